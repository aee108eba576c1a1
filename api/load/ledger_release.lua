-- KEYS: totals, leases, the holder's lease; ARGV: holder, id. 1: released, 0: not held.
if live(KEYS[1], KEYS[2], KEYS[3], ARGV[1], now_ms()) == 0 then
  return 0
end
local value = redis.call('HGET', KEYS[3], ARGV[2])
if not value then
  return 0
end
redis.call('HDEL', KEYS[3], ARGV[2])
local sep = string.find(value, ' ', 1, true)
subtract(KEYS[1], string.sub(value, 1, sep - 1), tonumber(string.sub(value, sep + 1)))
return 1
