-- KEYS: stream, deliveries counter. The job is about to run again: forget its delivery
-- count, and remove its stream if it ends with the `error` entry the worker wrote when it
-- dead-lettered the job (a stream that ends with a terminal entry is never run again).
-- 1: the stream was removed; 0: left as it was (absent, not a stream, or not ended by an
-- error).
redis.call('DEL', KEYS[2])
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' then return 0 end
local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #tail == 0 then return 0 end
local fields = tail[1][2]
for i = 1, #fields, 2 do
  if fields[i] == 'event' then
    if fields[i + 1] == 'error' then
      redis.call('DEL', KEYS[1])
      return 1
    end
    return 0
  end
end
return 0
