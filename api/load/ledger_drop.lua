-- KEYS: totals, leases, the holder's lease; ARGV: holder.
return drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
