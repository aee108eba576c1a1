-- KEYS: totals, leases, then the lease of each holder in ARGV. Drops those that lapsed
-- (each checked again: one may have renewed since it was seen lapsed).
local now, num_dropped = now_ms(), 0
for i, holder in ipairs(ARGV) do
  if live(KEYS[1], KEYS[2], KEYS[2 + i], holder, now) == 0 then
    num_dropped = num_dropped + 1
  end
end
return num_dropped
