-- Clear one stream (its blocks, engine hashes and watermark) unless another indexer owns it.
-- KEYS: meta, keys, hash (one hash tag: one slot). ARGV[1]: the writer's lease token.
-- Returns 1 when cleared (the writer then owns the stream: meta keeps only `owner`), 0 when
-- the stream's `owner` is another token (fenced: nothing changed).
local token = ARGV[1]
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= token then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'owner', token)
return 1
