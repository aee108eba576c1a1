-- KEYS: totals, leases, the holder's lease; ARGV: holder, ttl ms.
local now = now_ms()
local was_live = live(KEYS[1], KEYS[2], KEYS[3], ARGV[1], now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return was_live
