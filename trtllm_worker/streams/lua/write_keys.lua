-- Entry script: the write of parts whose keys are the call's declared KEYS (a single
-- node, or one hash slot of a cluster). No flags: it runs on any Redis, as legacy
-- scripts do. write.lua follows.
local K = KEYS
