-- Every command the worker's scripts call, each as `pcall` on probe keys (ACL refuses a
-- script's calls one by one, without naming the command): returns the names of those
-- refused. KEYS: a probe stream under the prefix, a side key of it; both are removed.
local refused = {}
local function try(name, ...)
  local reply = redis.pcall(name, ...)
  if type(reply) == 'table' and reply.err then refused[#refused + 1] = name end
end
try('XADD', KEYS[1], '*', 'probe', '1')
try('XLEN', KEYS[1])
try('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
try('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
try('XTRIM', KEYS[1], 'MAXLEN', 0)
try('EXISTS', KEYS[1])
try('EXPIRE', KEYS[1], 10)
try('PEXPIRE', KEYS[1], 10000)
try('HINCRBY', KEYS[2], 'probe', 1)
try('SET', KEYS[2], 'probe', 'PX', 10000)
try('GET', KEYS[2])
try('DEL', KEYS[1], KEYS[2])
return refused
