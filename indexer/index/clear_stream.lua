-- Clear or drop one stream unless another indexer owns it. (holders.lua is prepended.)
-- KEYS: meta, hash, lost, holders, members (one hash tag: one slot).
-- ARGV[1]: the writer's lease token ('' : no fence); ARGV[2]: '1' drop, '0' clear;
-- ARGV[3]: the stream's name.
-- Both take the stream out of its group's holders (its own blocks: `forget`) and delete its
-- meta, hash and lost set. A drop also frees its number in the group (and bumps #gen, so
-- readers reload the numbering before they name a stream by a reused number), deleting
-- the numbering with its last stream; a clear keeps the number. Returns 1 when done (a
-- fenced writer then owns the stream: meta keeps only `owner`), 0 when the stream's
-- `owner` is another token (fenced: nothing changed).
local meta, hashes, lost, holders, members = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token, drop, name = ARGV[1], ARGV[2] == '1', ARGV[3]
if token ~= '' then
  local owner = redis.call('HGET', meta, 'owner')
  if owner and owner ~= token then return 0 end
end
local number = redis.call('HGET', members, name)
if number then
  number = tonumber(number)
  forget(holders, hashes, lost, number)
end
redis.call('DEL', meta, hashes, lost)
if drop and number then
  local top = redis.call('HMGET', members, '#free', '#next')
  local free = (top[1] or '') .. char(floor(number / 256), number % 256)
  if #free / 2 >= tonumber(top[2] or '0') then
    redis.call('DEL', members)   -- its last stream: leave nothing behind
  else
    redis.call('HSET', members, '#free', free)
    redis.call('HDEL', members, name)
    bump_gen(members)
  end
end
if token ~= '' then redis.call('HSET', meta, 'owner', token) end
return 1
