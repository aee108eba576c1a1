-- Shared by load_put.lua, load_remove.lua and load_read.lua (store.py prepends it to each).
-- KEYS of each: the load HASH, the changes ZSET, the removed ZSET (one hash tag, {load});
-- ARGV[1] the caller's token, part of the epoch of a log it opens (a hash without one).
-- The field names are kvindex.indexer.redis.schema's LOAD_EPOCH, LOAD_SEQ, LOAD_TRIMMED and
-- ANSWERS_SUFFIX (a unit test holds them equal).
local EPOCH, SEQ, TRIMMED = '#epoch', '#seq', '#trimmed'
local ANSWERS = '/answers'

local function open_log()
  if redis.call('HEXISTS', KEYS[1], EPOCH) == 0 then
    -- the caller's token and the server's clock: a process that opens a log again (after
    -- a FLUSHALL) gives it another identity
    local t = redis.call('TIME')
    redis.call('HSET', KEYS[1], EPOCH, ARGV[1] .. '.' .. t[1] .. '.' .. t[2])
    -- a new log (the hash was lost): nothing recorded before describes this hash
    redis.call('HDEL', KEYS[1], SEQ, TRIMMED)
    redis.call('DEL', KEYS[2], KEYS[3])
  end
end
local function changed(replica)
  local seq = redis.call('HINCRBY', KEYS[1], SEQ, 1)
  redis.call('ZADD', KEYS[2], seq, replica)
  redis.call('ZREM', KEYS[3], replica)
end
