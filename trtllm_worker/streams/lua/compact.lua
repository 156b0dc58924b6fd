-- Trim a finished stream to its terminal entry (which holds `generated_text`); a stream
-- whose last entry is not terminal (expired and begun again) is left alone.
-- KEYS: stream. Returns the entries removed.
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if not last then return 0 end
local fields = last[2]
for i = 1, #fields, 2 do
  if fields[i] == 'event' then
    if fields[i + 1] == 'done' or fields[i + 1] == 'error' then
      return redis.call('XTRIM', KEYS[1], 'MAXLEN', 1)
    end
    return 0
  end
end
return 0
