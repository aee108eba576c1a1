-- A sharded indexer's stream records (kvindex.indexer.fleet.sync), fenced by its lease.
-- KEYS: the leases ZSET, the stream owners hash, the stream status hash (one slot).
-- ARGV: token, the unrouted counters' field and value, n, then n (stream, record) pairs,
-- then the streams whose records go (replicas removed from the fleet).
-- Nothing is written unless the token's lease runs (server clock): returns -1. Else a
-- stream's record is written only if the stream's claim is this token's (one handed over
-- keeps its new owner's); returns how many records were written.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = ARGV[1]
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], token))
if not expiry or expiry <= now then return -1 end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
local n = tonumber(ARGV[4])
local written = 0
for i = 5, 3 + 2 * n, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == token then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    written = written + 1
  end
end
for i = 5 + 2 * n, #ARGV do
  redis.call('HDEL', KEYS[3], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return written
