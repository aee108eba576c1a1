-- One indexer's lease (kvindex.indexer.ingest.membership), on the server's clock.
-- KEYS: the leases ZSET. ARGV: token, ttl (ms), mode ('join', 'renew' or 'leave').
-- Drops expired leases; a join adds the lease, a renew extends it only while it still runs
-- (an expired one is never revived: its holder must join again under a new token), a leave
-- removes it. Returns {held 0/1, expiry (ms, server clock), every live lease token...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token, mode = ARGV[1], ARGV[3]
local score = tonumber(redis.call('ZSCORE', KEYS[1], token))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held, expiry = 0, 0
if mode == 'leave' then
  redis.call('ZREM', KEYS[1], token)
elseif mode == 'join' or (score and score > now) then
  expiry = now + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], expiry, token)
  held = 1
end
local out = {held, expiry}
for _, live in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do out[#out + 1] = live end
return out
