-- The streams a live sharded indexer keeps (kvindex.indexer.fleet.view).
-- KEYS: the leases ZSET, the stream owners hash (one slot).
-- Returns every stream whose claim is a token whose lease runs (server clock); a claimed
-- stream not returned is orphaned until another indexer claims it.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = {}
for _, token in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  live[token] = true
end
local kept = {}
local owners = redis.call('HGETALL', KEYS[2])
for i = 1, #owners, 2 do
  if live[owners[i + 1]] then kept[#kept + 1] = owners[i] end
end
return kept
