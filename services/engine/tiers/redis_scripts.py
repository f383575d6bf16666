"""The Lua scripts of the Redis tier (redis.py): each changes a chunk's keys in one step on the server, so no reader
sees half a put and no pin, unpin or clear races another. Their KEYS and ARGV are the tier's key names
(shared/wire/redis_keys.py) and MAC'd entries; a value "of ours" starts with VALUE_MAGIC and our key id
(redis_values.py).
"""

# ARGV[n]: what a value of ours starts with (VALUE_MAGIC and our key id). A value that starts otherwise (another
# secret's, an older format's, a forgery) is not held for us: a put replaces it.
_OURS = """
local function ours(name, prefix)
  return redis.call('GETRANGE', name, 0, string.len(prefix) - 1) == prefix
end
"""
# KEYS: tmp, chunk. ARGV: our value prefix. The bytes are written; move them into place unless another put of
# ours got there first (its value may be pinned by now: replacing it would drop the pin's PERSIST).
FINISH_PUT = _OURS + """
if ours(KEYS[2], ARGV[1]) then redis.call('DEL', KEYS[1]) return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""
# A set key holding anything but a set (an older format's pin count, a forgery) is dropped, so that set commands
# on it cannot fail (and make the tier think Redis is down).
_SETS_ONLY = """
local function set_only(name)
  local kind = redis.call('TYPE', name)['ok']
  if kind ~= 'set' and kind ~= 'none' then redis.call('DEL', name) return 1 end
  return 0
end
"""
# KEYS: chunk, owners. ARGV: the caller's owner entry, ttl ms, our value prefix. Record the claim; 1 if the chunk
# is already held as a value of ours (its TTL refreshed, never shortened: it may carry a retention's extra).
CLAIM = _SETS_ONLY + _OURS + """
set_only(KEYS[2])
redis.call('SADD', KEYS[2], ARGV[1])
if not ours(KEYS[1], ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[2]) return 0 end
if redis.call('PTTL', KEYS[1]) >= 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2], 'GT')
  redis.call('PEXPIRE', KEYS[2], redis.call('PTTL', KEYS[1]))
else
  redis.call('PERSIST', KEYS[2])
end
return 1
"""
# KEYS: chunk, pins, owners. ARGV: a new pin entry.
PIN = _SETS_ONLY + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
set_only(KEYS[2])
redis.call('SADD', KEYS[2], ARGV[1]) redis.call('PERSIST', KEYS[1]) redis.call('PERSIST', KEYS[3])
return 1
"""
# KEYS: chunk, pins, owners. ARGV: ttl ms, the pin entry to take back ('' for none), the number n of bad pin
# entries, n bad pin entries, bad owner entries (bad: they failed their MAC when the caller read the sets).
# Removes them; when that leaves no pin, the chunk is volatile again, or deleted when a clear left it to its pin
# (nobody claims it). An entry added since the caller read the sets counts as good: a concurrent pin holds.
# 1 if the entry was taken back.
UNPIN = _SETS_ONLY + """
local dropped = set_only(KEYS[2])
set_only(KEYS[3])
local taken = 0
if ARGV[2] ~= '' then taken = redis.call('SREM', KEYS[2], ARGV[2]) end
local nbad = tonumber(ARGV[3])
for i = 4, 3 + nbad do dropped = dropped + redis.call('SREM', KEYS[2], ARGV[i]) end
for i = 4 + nbad, #ARGV do redis.call('SREM', KEYS[3], ARGV[i]) end
if (taken == 0 and dropped == 0) or redis.call('SCARD', KEYS[2]) > 0 or redis.call('EXISTS', KEYS[1]) == 0 then
  return taken
end
if redis.call('SCARD', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[1]) redis.call('PEXPIRE', KEYS[3], ARGV[1])
end
return taken
"""
# KEYS: chunk, pins, owners. ARGV: ttl ms, the caller's owner entry, the number n of bad owner entries, n bad
# owner entries, bad pin entries (as for UNPIN). Take back the caller's claim; the chunk goes when nobody
# claims it and no pin holds it, and is volatile again when only bad pins held it. 1 if the caller had claimed it.
CLEAR = _SETS_ONLY + """
set_only(KEYS[2]) set_only(KEYS[3])
if redis.call('SREM', KEYS[3], ARGV[2]) == 0 then return 0 end
local nbad = tonumber(ARGV[3])
for i = 4, 3 + nbad do redis.call('SREM', KEYS[3], ARGV[i]) end
for i = 4 + nbad, #ARGV do redis.call('SREM', KEYS[2], ARGV[i]) end
if redis.call('SCARD', KEYS[2]) == 0 then
  if redis.call('SCARD', KEYS[3]) == 0 then
    redis.call('DEL', KEYS[1])
  elseif redis.call('PTTL', KEYS[1]) == -1 then
    redis.call('PEXPIRE', KEYS[1], ARGV[1]) redis.call('PEXPIRE', KEYS[3], ARGV[1])
  end
end
return 1
"""
# KEYS: the principal's retained set (redis_retention.py). ARGV: now (unix ms), the chunk's member, its
# retention's end (unix ms), its bytes, the principal's bound in bytes. Retentions that ended leave the set; a
# chunk retained already takes the later end; a new one is added while the set's bytes stay within the bound.
# 1 if the chunk is retained. Members are read as untrusted: one without a byte count counts nothing.
RETAIN = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZADD', KEYS[1], 'GT', ARGV[3], ARGV[2])
  return 1
end
local held = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  held = held + (tonumber(string.match(m, ':(%d+)$')) or 0)
end
if held + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return 1
"""
