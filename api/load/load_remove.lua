-- ARGV: token, replica, tombstones kept. 1 when removed, 0 when nothing was stored.
if redis.call('HDEL', KEYS[1], ARGV[2], ARGV[2] .. ANSWERS) == 0 then
  return 0
end
open_log()
local seq = redis.call('HINCRBY', KEYS[1], SEQ, 1)
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], seq, ARGV[2])
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[3])
if over > 0 then
  local newest = redis.call('ZRANGE', KEYS[3], over - 1, over - 1, 'WITHSCORES')
  redis.call('HSET', KEYS[1], TRIMMED, newest[2])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, over - 1)
end
return 1
