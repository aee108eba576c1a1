-- Longest run of leading keys one stream holds, stopping at the first miss.
-- KEYS: keys (block field -> packed tier counts: gpu + cpu * 2^16 + other * 2^32)
-- ARGV: concatenated 6-byte block fields (the low 6 bytes of each block key)
-- Returns one byte per matched block: its best tier (0 GPU, 1 CPU, 2 other).
local keys = KEYS[1]
local wanted = ARGV[1]
local call, sub, floor = redis.call, string.sub, math.floor
local out = {}
for off = 1, #wanted, 6 do
  local v = call('HGET', keys, sub(wanted, off, off + 5))
  if not v then break end
  v = tonumber(v)
  if v % 65536 > 0 then
    out[#out + 1] = '\0'
  elseif floor(v / 65536) % 65536 > 0 then
    out[#out + 1] = '\1'
  else
    out[#out + 1] = '\2'
  end
end
return table.concat(out)
