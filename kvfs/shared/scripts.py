"""The Lua scripts of the shared tier: every change to a session is one script on the
session's slot, so the lease check, the chunk write and the file index change together
(a node that lost its lease cannot write; a reader never sees an index ahead of its chunks).

Retention: every key of a session carries the same deadline (now + retention), refreshed
for all of them at once when the index's TTL has fallen below 90 % of the retention; a key
written in between gets a full retention of its own. So no chunk ever expires before the
index that points at it, and the refresh walks the session's keys only about once per
tenth of the retention.

Wherever a script takes a ``node`` argument it is this node's sealed lease value
(``seal.Sealer.lease``), compared byte for byte with the one stored.
"""

from __future__ import annotations

from typing import Any


def status(res: list[Any]) -> str:
    """The status word of a script's reply (``OK``, ``LEASE``, ``BUSY``...)."""
    s = res[0]
    return s.decode() if isinstance(s, bytes) else str(s)


def text(v: Any) -> str:
    """A reply field as text (lease values, owners)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function refresh(prefix, retention, chunk)
  if retention <= 0 then return end
  local idx = prefix .. 'files'
  local ttl = redis.call('PTTL', idx)
  if ttl >= retention * 0.9 then return end
  local deadline = now_ms() + retention
  local all = redis.call('HGETALL', idx)
  for i = 1, #all, 2 do
    local n = math.ceil(tonumber(all[i + 1]) / chunk)
    for c = 0, n - 1 do redis.call('PEXPIREAT', prefix .. all[i] .. ':' .. c, deadline) end
  end
  for _, k in ipairs({'files', 'vers', 'meta', 'owner', 'holder', 'sync'}) do
    redis.call('PEXPIREAT', prefix .. k, deadline)
  end
end
-- APPEND allocates greedily (up to twice a value's length); a copy of the value is exact.
-- COPY + RENAME trims a chunk where it is finished (full, or its session's lease released)
-- and replicates as two short commands, not as the chunk's bytes.
local function trim(prefix, key)
  redis.call('COPY', key, prefix .. 'tmp', 'REPLACE')
  redis.call('RENAME', prefix .. 'tmp', key)
end
-- a file's content version (a sealed token the writing node made): set when the file is
-- made or rewritten, kept by appends; the hash expires with the file index
local function stamp(vers, files, file, token, retention)
  redis.call('HSET', vers, file, token)
  if retention > 0 and redis.call('PTTL', vers) < 0 then
    local ttl = redis.call('PTTL', files)
    redis.call('PEXPIRE', vers, ttl > 0 and ttl or retention)
  end
end
local function put(key, value, mode, retention)
  if mode == 'A' and redis.call('EXISTS', key) == 1 then
    return redis.call('APPEND', key, value)
  end
  redis.call('SET', key, value)
  if retention > 0 then redis.call('PEXPIRE', key, retention) end
  return #value
end
"""

# KEYS: files, lease, vers, chunk keys...   ARGV: node, file, offset, new size, retention ms,
# chunk bytes, prefix, lease ms, first mode ('A' append to the chunk, 'S' start it), version
# token (set if the file is new or has none), pieces...
# -> {'OK', length of the last chunk value, the file's version} | {'LEASE', owner}
#    | {'SIZE', size}
APPEND = _COMMON + """
local owner = redis.call('GET', KEYS[2])
if owner ~= ARGV[1] then return {'LEASE', owner or ''} end
local had = redis.call('HGET', KEYS[1], ARGV[2])
local size = tonumber(had or '0')
if size ~= tonumber(ARGV[3]) then return {'SIZE', tostring(size)} end
local retention = tonumber(ARGV[5])
local last = 0
for i = 4, #KEYS do
  last = put(KEYS[i], ARGV[i + 7], i == 4 and ARGV[9] or 'S', retention)
end
if ARGV[9] == 'A' and (#KEYS > 4 or tonumber(ARGV[4]) % tonumber(ARGV[6]) == 0) then
  trim(ARGV[7], KEYS[4])        -- the appended chunk is full now
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
local version = redis.call('HGET', KEYS[3], ARGV[2])
if not had or not version then
  version = ARGV[10]
  stamp(KEYS[3], KEYS[1], ARGV[2], version, retention)
end
redis.call('PEXPIRE', KEYS[2], ARGV[8])
refresh(ARGV[7], retention, tonumber(ARGV[6]))
return {'OK', tostring(last), version}
"""

# KEYS: files, lease, vers, chunk n, chunks n+1..   ARGV: node, file, expected size, new
# size (-1: remove the file), value of chunk n ('' deletes it), retention, chunk bytes,
# prefix, version token ('' keeps the file's version: a compaction, same bytes)
# -> {'OK', bytes freed} | {'LEASE', owner} | {'SIZE', size}
REWRITE = _COMMON + """
local owner = redis.call('GET', KEYS[2])
if owner ~= ARGV[1] then return {'LEASE', owner or ''} end
local size = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '-1')
if size ~= tonumber(ARGV[3]) then return {'SIZE', tostring(size)} end
local retention = tonumber(ARGV[6])
local freed = 0
for i = 4, #KEYS do freed = freed + redis.call('STRLEN', KEYS[i]) end
redis.call('DEL', unpack(KEYS, 4))
if #ARGV[5] > 0 then freed = freed - put(KEYS[4], ARGV[5], 'S', retention) end
if tonumber(ARGV[4]) < 0 then
  redis.call('HDEL', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
else
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
  if #ARGV[9] > 0 then stamp(KEYS[3], KEYS[1], ARGV[2], ARGV[9], retention) end
end
refresh(ARGV[8], retention, tonumber(ARGV[7]))
return {'OK', tostring(freed)}
"""

# KEYS: files, lease, meta, owner   ARGV: node, value, retention, chunk bytes, prefix,
# owner record ('' leaves it as it is)
# -> {'OK', bytes added} | {'LEASE', owner}
PUT_META = _COMMON + """
local owner = redis.call('GET', KEYS[2])
if owner ~= ARGV[1] then return {'LEASE', owner or ''} end
local retention = tonumber(ARGV[3])
local old = redis.call('STRLEN', KEYS[3]) + redis.call('STRLEN', KEYS[4])
local ttl = redis.call('PTTL', KEYS[1])
local function keep(key, value)
  redis.call('SET', key, value)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl)
  elseif retention > 0 then redis.call('PEXPIRE', key, retention) end
end
keep(KEYS[3], ARGV[2])
if #ARGV[6] > 0 then keep(KEYS[4], ARGV[6]) end
refresh(ARGV[5], retention, tonumber(ARGV[4]))
return {'OK', tostring(redis.call('STRLEN', KEYS[3]) + redis.call('STRLEN', KEYS[4]) - old)}
"""

# KEYS: files, lease, meta, holder, sync, owner, vers   ARGV: node, chunk bytes, prefix, mode
# mode 'delete': refused while another node holds the lease; 'evict': refused while anyone does
# -> {'OK', bytes freed} | {'BUSY', owner, ms left}
DELETE = """
local owner = redis.call('GET', KEYS[2])
if owner and (ARGV[4] == 'evict' or owner ~= ARGV[1]) then
  return {'BUSY', owner, redis.call('PTTL', KEYS[2])}
end
local chunk = tonumber(ARGV[2])
local freed = redis.call('STRLEN', KEYS[3]) + redis.call('STRLEN', KEYS[6])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  for c = 0, math.ceil(tonumber(all[i + 1]) / chunk) - 1 do
    local k = ARGV[3] .. all[i] .. ':' .. c
    freed = freed + redis.call('STRLEN', k)
    redis.call('DEL', k)
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
return {'OK', tostring(freed)}
"""

# KEYS: lease, holder   ARGV: node, lease ms, retention ms
# -> {'NEW', previous holder or ''} | {'TAKEOVER', previous holder} | {'RENEWED', ''}
#    | {'BUSY', owner, ms left}
ACQUIRE = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'RENEWED', ''}
end
if owner then return {'BUSY', owner, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local prev = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], ARGV[1])
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
-- a lease value is '<node>|<lease ms>|<MAC>': the same node is no takeover
if prev and string.match(prev, '^[^|]*') ~= string.match(ARGV[1], '^[^|]*') then
  return {'TAKEOVER', prev}
end
return {'NEW', prev or ''}
"""

# KEYS: lease, holder   ARGV: node, lease ms  -> {'OK'} | {'RETAKEN'} | {'LOST', owner or ''}
# A lease that expired with nobody taking it since (the holder record is still this node)
# is taken again: no other node can have written in between.
RENEW = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'OK'}
end
if owner then return {'LOST', owner} end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'LOST', ''} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'RETAKEN'}
"""

# KEYS: lease, holder, files   ARGV: node, chunk bytes, prefix  -> 1 released, 0 not ours
# The session is finished for now: trim the partial last chunk of each file.
RELEASE = _COMMON + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
local chunk = tonumber(ARGV[2])
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  local size = tonumber(all[i + 1])
  local key = ARGV[3] .. all[i] .. ':' .. math.floor(size / chunk)
  if size % chunk ~= 0 and redis.call('EXISTS', key) == 1 then trim(ARGV[3], key) end
end
return 1
"""

# KEYS: files, sync, meta   ARGV: node, retention ms, bytes of the meta's head to return
# A write (the marker) so that a WAIT on the same connection covers everything before it.
SYNC = """
redis.call('SET', KEYS[2], ARGV[1])
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return {redis.call('HGETALL', KEYS[1]), redis.call('GETRANGE', KEYS[3], 0, tonumber(ARGV[3]) - 1)}
"""

# KEYS: lease, holder   ARGV: the lease value seen, this node's lease value, lease ms,
# retention ms. A lease value that does not verify was not set by a node (or is this node's
# own from before a restart with other settings): replace it, unless it changed since it
# was read.  -> 1 replaced, 0 changed meanwhile
SEIZE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2])
if tonumber(ARGV[4]) > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return 1
"""

# Capacity bookkeeping, one slot for the whole cluster.
# KEYS: lru (zset session -> last write ms), bytes (hash session -> bytes), total
# ARGV: session, delta bytes, retention ms   -> total bytes
NOTE_WRITE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
local total = redis.call('INCRBY', KEYS[3], ARGV[2])
local retention = tonumber(ARGV[3])
if retention > 0 then
  -- sessions not written for a whole retention have expired on their own
  local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - retention), 'LIMIT', 0, 64)
  for _, s in ipairs(gone) do
    total = redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], s) or '0'))
    redis.call('HDEL', KEYS[2], s)
    redis.call('ZREM', KEYS[1], s)
  end
end
return total
"""

# KEYS: lru, bytes, total   ARGV: session   -> total bytes
FORGET = """
local b = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DECRBY', KEYS[3], b)
"""
