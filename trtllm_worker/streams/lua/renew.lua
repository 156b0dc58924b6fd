-- Renew the lease if the token still holds it. KEYS: lease. ARGV: token, ttl ms.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
