#!lua flags=allow-cross-slot-keys
-- Entry script: the write of a whole Redis Cluster node in one call. A call may declare
-- keys of one slot only, so the keys of the node's many slots come in ARGV[3], a
-- MessagePack array, and the flag above lets the script touch them. Redis 7 refuses a
-- key that is not the node's ("non local key"): the caller then writes per slot. A
-- Redis before 7.0 refuses the flag itself. write.lua follows.
local K = cmsgpack.unpack(ARGV[3])
