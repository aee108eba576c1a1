-- Longest run of leading keys each stream holds, stopping at that stream's first miss.
-- KEYS: one `keys` hash per stream (block field -> packed tier counts: gpu + cpu * 2^16 +
--       other * 2^32)
-- ARGV: the block keys, 8 bytes big-endian each; a block's field is its key's low 6 bytes
-- Returns, per stream in KEYS order, one byte per matched block: its best tier (0 GPU,
-- 1 CPU, 2 other).
-- Several streams per call on purpose: one EVALSHA per stream cost more than its HGETs
-- (each call copies ARGV into Lua), so the store sends a few streams per call. On Redis
-- Cluster the streams of one call must share a slot: the store groups them per slot.
local wanted = ARGV[1]
local call, sub, floor, concat = redis.call, string.sub, math.floor, table.concat

local function walk(hash)
  local out = {}
  for off = 3, #wanted, 8 do
    local v = call('HGET', hash, sub(wanted, off, off + 5))
    if not v then break end
    if v == '1' then  -- the common case: held once, on GPU
      out[#out + 1] = '\0'
    else
      v = tonumber(v)
      if v % 65536 > 0 then
        out[#out + 1] = '\0'
      elseif floor(v / 65536) % 65536 > 0 then
        out[#out + 1] = '\1'
      else
        out[#out + 1] = '\2'
      end
    end
  end
  return concat(out)
end

local result = {}
for i = 1, #KEYS do
  result[i] = walk(KEYS[i])
end
return result
