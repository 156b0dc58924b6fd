-- The fenced write of a batch: the body shared by the two entry scripts, which run it
-- after one line that sets `K`, the parts' keys (stream, lease per part):
--   write_keys.lua  K = KEYS                     one call per node, or per hash slot
--   write_node.lua  K = cmsgpack.unpack(ARGV[3])  a Redis Cluster node's keys of many slots
--
-- ARGV[1]: the TTL of a finished stream; ARGV[2]: one MessagePack array holding, per
-- part: lease token ('': the caller holds none), the seq of its first token entry, a
-- code (8 n + 4 when top logprobs follow + 2 when logprobs follow + 1 when a terminal
-- entry follows), then n token ids, n texts, (n logprobs, '' for none), (n top logprobs
-- as JSON text, '' for none), then (the terminal entry) its id ('': after
-- the tail, unless the stream has ended already), the number of fields, field, value, ...,
-- then its usage: the usage key ('': not counted), its TTL, the tenant, the input tokens,
-- the LoRA adapter ('': none); then, for a batch line's record, the model's public name
-- and the writer's clock in milliseconds.
-- Token entry k (from 0) gets id 0-<seq + k> and index seq + k - 1.
--
-- Returns per part the entries written, -1 when the fence refused (the lease is
-- another's, or anyone's when the caller holds none), -2 when the stream lacks entries
-- before the first one given (nothing is written), or 'WRONGTYPE ...' for a key that is
-- not a stream; any other error fails the call. An entry refused as "equal or smaller"
-- was stored by an earlier try and is skipped.
local ttl = tonumber(ARGV[1])
local argv = cmsgpack.unpack(ARGV[2])

local function owns(lease, token)
  if token == '' then return redis.call('EXISTS', lease) == 0 end
  return redis.call('GET', lease) == token
end

-- A key that is not a stream is refused for good (the error is returned for its request
-- alone); any other error (READONLY from a demoted master, OOM, ...) is the server's
-- state, not the request's: it fails the whole call, and the caller retries.
local function refused(err)
  if string.find(err, '^WRONGTYPE') then return err end
  error({err = err})
end

local function stored(reply)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'equal or smaller', 1, true) then return 0 end
    return refused(reply.err)
  end
  return 1
end

-- Entry ids run 0-1, 0-2, ... without holes, so a stream holds exactly as many entries
-- as the sequence number before its next one. Fewer: entries stored earlier are gone (a
-- failover promoted a replica that had not received them); writing on would leave a
-- hole in the indices.
local function lost(stream, seq)
  if seq == nil then return false end
  local len = redis.pcall('XLEN', stream)
  if type(len) ~= 'number' then return false end
  return len < seq - 1
end

-- A job's usage, per tenant and day: counted by the call that stores its terminal entry,
-- so exactly once per job. Its generated tokens are the token entries before that entry
-- (ids 0-1 .. 0-n, the terminal one 0-<n + 1>). The key lives `usage_ttl` seconds after
-- its last write. The key is the stream's slot's (streams/usage.py), never declared: a
-- script may touch an undeclared key of its own slot.
-- A job with a LoRA adapter is also counted under `adapter_<counter>:<tenant>:<adapter>`
-- (an adapter's name holds no colon): a breakdown of the tenant's totals, never added
-- to them.
local function count(usage, id, tenant, input_tokens, usage_ttl, adapter)
  if usage == '' then return end
  local generated = tonumber(string.match(id, '-(%d+)$')) - 1
  redis.call('HINCRBY', usage, 'jobs:' .. tenant, 1)
  redis.call('HINCRBY', usage, 'input_tokens:' .. tenant, input_tokens)
  redis.call('HINCRBY', usage, 'generated_tokens:' .. tenant, generated)
  if adapter ~= nil and adapter ~= '' then
    local who = tenant .. ':' .. adapter
    redis.call('HINCRBY', usage, 'adapter_jobs:' .. who, 1)
    redis.call('HINCRBY', usage, 'adapter_input_tokens:' .. who, input_tokens)
    redis.call('HINCRBY', usage, 'adapter_generated_tokens:' .. who, generated)
  end
  redis.call('EXPIRE', usage, usage_ttl)
end

-- A batch line's record (contract/batches.py): a stream whose side key `{<stream>}:batch`
-- holds a pending marker (JSON: state, custom_id, counts, ttl, keep_until, logprobs) is a
-- line of a batch; the terminal entry just stored replaces the marker with the line's record (the
-- entry, the model, the time, and when `logprobs` is set its token entries' ids, texts
-- and logprobs), and the line counts once in its batch's counters, `ok` or `err` (and
-- `cancelled` or `expired` for an `err` line cancelled or ended by its deadline). A side
-- key that is not a pending marker is left alone. The record and the counters live `ttl`
-- seconds, and at least until `keep_until` (Unix seconds: the batch's window end plus
-- `ttl`), so a line that ends early outlives a batch that runs longer than `ttl`; the
-- batch's end then keeps every key `ttl` from then (client/batches.py).
local function record(stream, fields, model, now)
  local key = '{' .. stream .. '}:batch'
  local raw = redis.pcall('GET', key)
  if type(raw) ~= 'string' then return end
  local decoded, line = pcall(cjson.decode, raw)
  if not decoded or type(line) ~= 'table' or line.state ~= 'pending' then return end
  local entry = {}
  for i = 1, #fields, 2 do entry[fields[i]] = fields[i + 1] end
  local ok = entry.event == 'done' and entry.finish_reason ~= 'cancelled'
    and entry.finish_reason ~= 'deadline'
  local out = {state = 'ended', ok = ok, t = now, model = model, custom_id = line.custom_id,
    entry = entry}
  if ok and line.logprobs == true then
    local tokens = {}
    for _, e in ipairs(redis.call('XRANGE', stream, '-', '+')) do
      local f, t = e[2], {}
      for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
      if t.event == 'token' then
        tokens[#tokens + 1] = {tonumber(t.token_id), t.text, t.logprob or '',
          t.top_logprobs or ''}
      end
    end
    out.tokens = tokens
  end
  local keep = line.ttl
  if type(line.keep_until) == 'number' and type(now) == 'number' then
    keep = math.max(keep, line.keep_until - math.floor(now / 1000))
  end
  redis.call('SET', key, cjson.encode(out), 'EX', keep)
  redis.call('HINCRBY', line.counts, ok and 'ok' or 'err', 1)
  if entry.finish_reason == 'cancelled' then
    redis.call('HINCRBY', line.counts, 'cancelled', 1)
  elseif entry.finish_reason == 'deadline' or entry.code == 'deadline_exceeded' then
    redis.call('HINCRBY', line.counts, 'expired', 1)
  end
  redis.call('EXPIRE', line.counts, keep)
end

-- The one place a stream ends: its terminal entry, its expiry, its lease released, its
-- job's usage counted (`usage`: key, TTL, tenant, input tokens, adapter), its batch line
-- recorded (`line`: model, clock). A stream found ended already, or a terminal entry an
-- earlier try stored, counts and records nothing.
local function end_stream(stream, lease, token, id, fields, usage, line)
  if id == '' then
    local tail = redis.pcall('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    if tail.err then return refused(tail.err) end
    local seq = 1
    if #tail > 0 then
      local f = tail[1][2]
      for i = 1, #f, 2 do
        if f[i] == 'event' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
      end
      seq = tonumber(string.match(tail[1][1], '-(%d+)$')) + 1
    end
    id = '0-' .. seq
  end
  local result = stored(redis.pcall('XADD', stream, id, unpack(fields)))
  if type(result) == 'string' then return result end
  redis.call('EXPIRE', stream, ttl)
  if token ~= '' then redis.call('DEL', lease) end
  if result == 1 then
    count(usage[1], id, usage[3], tonumber(usage[4]), usage[2], usage[5])
    record(stream, fields, line[1], line[2])
  end
  return result
end

local results = {}
local a = 1
for s = 1, #K, 2 do
  local stream, lease, token = K[s], K[s + 1], argv[a]
  local seq, code = tonumber(argv[a + 1]), tonumber(argv[a + 2])
  local count = math.floor(code / 8)
  local with_top = code % 8 >= 4
  local with_logprobs = code % 4 >= 2
  local has_end = code % 2 == 1
  local ids, texts = a + 3, a + 3 + count
  local tops = texts + (with_logprobs and 2 or 1) * count
  local after = tops + (with_top and 1 or 0) * count
  local nfields = has_end and tonumber(argv[after + 1]) or 0
  a = has_end and after + 2 + nfields * 2 + 7 or after
  local first = nil
  if count > 0 then
    first = seq
  elseif has_end and argv[after] ~= '' then
    first = tonumber(string.match(argv[after], '-(%d+)$'))
  end
  local result = 0
  if not owns(lease, token) then
    result = -1
  elseif lost(stream, first) then
    result = -2
  else
    for k = 0, count - 1 do
      local ok
      local logprob = with_logprobs and argv[texts + count + k] or ''
      local top = with_top and argv[tops + k] or ''
      if logprob == '' and top == '' then
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), 'event', 'token',
          'index', seq + k - 1, 'token_id', argv[ids + k], 'text', argv[texts + k])
      else
        local fields = {'event', 'token', 'index', seq + k - 1, 'token_id', argv[ids + k],
          'text', argv[texts + k]}
        if logprob ~= '' then
          fields[#fields + 1] = 'logprob'
          fields[#fields + 1] = logprob
        end
        if top ~= '' then
          fields[#fields + 1] = 'top_logprobs'
          fields[#fields + 1] = top
        end
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), unpack(fields))
      end
      ok = stored(ok)
      if type(ok) == 'string' then result = ok break end
      result = result + ok
    end
    if has_end and type(result) == 'number' then
      local fields = {}
      for k = 1, nfields * 2 do fields[k] = argv[after + 1 + k] end
      local u = after + 2 + nfields * 2
      local usage = {argv[u], argv[u + 1], argv[u + 2], argv[u + 3], argv[u + 4]}
      local line = {argv[u + 5], argv[u + 6]}
      local ended = end_stream(stream, lease, token, argv[after], fields, usage, line)
      if type(ended) == 'string' then result = ended else result = result + ended end
    end
  end
  results[#results + 1] = result
end
return results
