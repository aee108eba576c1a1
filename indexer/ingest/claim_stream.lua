-- A sharded indexer claims a stream in the fleet's slot (kvindex.indexer.ingest.membership).
-- KEYS: the leases ZSET, the stream owners hash. ARGV: token, the stream's name.
-- Only while the token's lease runs (server clock) is the stream recorded as its; returns
-- 1 when claimed, 0 when the lease has run out (nothing written).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if not expiry or expiry <= now then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return 1
