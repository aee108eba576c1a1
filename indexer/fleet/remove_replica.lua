-- Drop a replica's spec, its streams' statuses and its health record atomically.
-- KEYS: replicas hash, stream status hash, replica health hash. ARGV[1]: the replica id.
-- Returns the spec, or false when the replica is not registered.
local spec = redis.call('HGET', KEYS[1], ARGV[1])
if not spec then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local prefix = ARGV[1] .. '/'
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, #prefix) == prefix then redis.call('HDEL', KEYS[2], f) end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return spec
