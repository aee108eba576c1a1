-- One indexer's lease renewal (kvindex.indexer.ingest.membership).
-- KEYS: the leases ZSET. ARGV: token, now (ms), ttl (ms), leave (0/1).
-- Drops expired leases, extends (or removes) this one, returns every live lease token.
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[4] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
end
return redis.call('ZRANGE', KEYS[1], 0, -1)
