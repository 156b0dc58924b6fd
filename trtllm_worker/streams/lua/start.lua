-- A job's first call: take the lease (or find it ours already) and read the stream's
-- tail and the cancel mark, in one round trip.
-- KEYS: stream, lease, cancel mark. ARGV: token, lease ms.
-- Returns nil: another holds the lease; {-1, error}: the key is not a stream (the lease
-- is let go); else {1, cancel mark exists, the tail entry (or none)}.
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[2]) ~= ARGV[1] then return false end
end
local tail = redis.pcall('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if type(tail) == 'table' and tail.err then
  redis.call('DEL', KEYS[2])
  return {-1, tail.err}
end
return {1, redis.call('EXISTS', KEYS[3]), tail}
