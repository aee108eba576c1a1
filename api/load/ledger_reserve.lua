-- KEYS: totals, leases, the holder's lease; ARGV: holder, ttl ms, id, replica, tokens.
local now = now_ms()
local was_live = live(KEYS[1], KEYS[2], KEYS[3], ARGV[1], now)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4] .. ' ' .. ARGV[5])
redis.call('HINCRBY', KEYS[1], ARGV[4], 1)
redis.call('HINCRBY', KEYS[1], ARGV[4] .. '/tokens', ARGV[5])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return was_live
