-- A batch of receipts appended to the journal's Stream, one XADD each, in the batch's order.
-- KEYS[1]: the Stream; ARGV[1]: its MAXLEN (~: at least that many kept, a node more at most);
-- then (request id, receipt JSON) pairs. Returns how many were appended.
local n = 0
for i = 2, #ARGV - 1, 2 do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'id', ARGV[i], 'receipt', ARGV[i + 1])
  n = n + 1
end
return n
