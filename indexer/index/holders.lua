-- Shared by apply_batch.lua and clear_stream.lua (the store prepends it to each): a group's
-- holder records of one block (redis_schema.py). A record is 2 bytes, number * 4 + form:
-- form 0, 1, 2 = held once, on GPU, CPU, other; form 3 = 6 more bytes, the counts (gpu,
-- cpu, other: u16 big-endian). Records are sorted by number, so equal holders and counts
-- give equal values.
local byte, char, sub, floor = string.byte, string.char, string.sub, math.floor
local MAX_COUNT = 65535

-- (position, length) of `number`'s record in v; length 0 (and where it would go) if absent
local function find_record(v, number)
  local i, n = 1, #v
  while i <= n do
    local h = byte(v, i) * 256 + byte(v, i + 1)
    local num = floor(h / 4)
    local len = (h % 4 == 3) and 8 or 2
    if num >= number then
      if num == number then return i, len end
      return i, 0
    end
    i = i + len
  end
  return i, 0
end

-- The record of `number` holding a block once, on tier t (1-3): 2 bytes
local function single(number, t)
  local h = number * 4 + t - 1
  return char(floor(h / 256), h % 256)
end

local function encode_record(number, g, c, o)
  local total = g + c + o
  if total == 0 then return '' end
  if total == 1 then
    return single(number, (g == 1) and 1 or ((c == 1) and 2 or 3))
  end
  local h = number * 4 + 3
  return char(floor(h / 256), h % 256, floor(g / 256), g % 256,
              floor(c / 256), c % 256, floor(o / 256), o % 256)
end

-- v with `number`'s count on tier t (1-3) moved by d (1 or -1). Returns the new value ('' if
-- no holder is left), the count on t before, and whether `number` still holds the block.
-- A removal from a tier not held changes nothing; a count saturates at MAX_COUNT.
-- (Counts as three locals, not a table: this runs once per op of every batch.)
local function bump(v, number, t, d)
  if v == '' and d > 0 then return single(number, t), 0, true end
  local i, len = find_record(v, number)
  local g, c, o = 0, 0, 0
  if len == 2 then
    local form = byte(v, i + 1) % 4
    if form == 0 then g = 1 elseif form == 1 then c = 1 else o = 1 end
  elseif len == 8 then
    g = byte(v, i + 2) * 256 + byte(v, i + 3)
    c = byte(v, i + 4) * 256 + byte(v, i + 5)
    o = byte(v, i + 6) * 256 + byte(v, i + 7)
  end
  local before = (t == 1 and g) or (t == 2 and c) or o   -- 0 is true in Lua
  if (d < 0 and before == 0) or (d > 0 and before == MAX_COUNT) then
    return v, before, len > 0
  end
  if t == 1 then g = g + d elseif t == 2 then c = c + d else o = o + d end
  local record = encode_record(number, g, c, o)
  return sub(v, 1, i - 1) .. record .. sub(v, i + len), before, record ~= ''
end

-- Remove `number` from the holders of every block it may hold: the keys its engine-hash map
-- names and its `lost` set (redis_schema.py); then delete both. Costs the stream's own
-- blocks (two calls each), never a scan.
local function forget(holders, hashes, lost, number)
  local function drop_from(keys)
    for i = 1, #keys do
      local field = sub(keys[i], 3, 8)
      local v = redis.call('HGET', holders, field)
      if v then
        local at, len = find_record(v, number)
        if len > 0 then
          local rest = sub(v, 1, at - 1) .. sub(v, at + len)
          if rest == '' then
            redis.call('HDEL', holders, field)
          else
            redis.call('HSET', holders, field, rest)
          end
        end
      end
    end
  end
  drop_from(redis.call('HVALS', hashes))
  drop_from(redis.call('SMEMBERS', lost))
  redis.call('DEL', hashes, lost)
end

-- Move a group's #gen on (a number was given or freed). A numbering made afresh (a new
-- group, or one Redis lost) starts from the server's clock in microseconds, so a gen a
-- reader remembers from before is never met again (it would name streams by old numbers).
local function bump_gen(members)
  if redis.call('HEXISTS', members, '#gen') == 0 then
    local now = redis.call('TIME')
    redis.call('HSET', members, '#gen', now[1] .. string.format('%06d', tonumber(now[2])))
  end
  redis.call('HINCRBY', members, '#gen', 1)
end
