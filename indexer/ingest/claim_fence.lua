-- A sharded indexer takes a stream's index fence (kvindex.indexer.ingest.membership).
-- KEYS: the stream's meta (its index slot). ARGV: token, the lease's expiry (ms, the
-- leases' server clock). Refused (0, nothing written) once the expiry has passed here,
-- so a writer paused between its claim and this call cannot take the fence back; else the
-- meta's `owner` is the token (what every batch script checks) and 1 is returned.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(ARGV[2]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
return 1
