-- quota: a bucket in Redis, its token layers and its control record. This
-- is the core every script of the bucket shares. Each script is the
-- prelude (internal/redisx), this core, the parts it needs and its own
-- body, joined in that order (internal/store's scripts.go), and is loaded
-- as a script of its own:
--   script.lua  the take: core, classes, timeline, tenants, script;
--   update.lua  refund, probe, pause, lower, adjust and resuming: core,
--               classes, timeline, tenants, update;
--   record.lua  the control record's operations: core, classes,
--               timeline, record.
-- Each body's header is its contract: its KEYS, its ARGV, named as locals
-- at its top, and its reply.
--
-- A layer is kept as a single number, its theoretical arrival time (tat):
-- the instant, in microseconds, at which the layer would be full again. At
-- time now it holds burst - (tat - now) * rate tokens, so tokens can run
-- into debt: a take always succeeds when its wait is acceptable, moves tat
-- forward and tells the caller how long to sleep until its tokens have
-- accrued. Later callers queue behind it, first come, first served, with
-- one call each.
--
-- A bucket may obey several limits at once (10 a second and 300 a
-- minute): one key per layer, all in the bucket's hash slot, checked and
-- taken together, all or nothing. A bucket may also meter several things
-- at once, one layer each: a request then takes its own amount from each,
-- all or nothing, with the wait of the slowest.
--
-- The control record, a hash beside the layers, holds what changes how the
-- bucket is taken, whoever set it:
--   rate, burst   the operator's override of the first layer's Limit;
--                 every operation computes with it in place of the Limit
--                 its caller passes;
--   since, until  the bucket's pause, one for every source: when it began
--                 and when it ends, microseconds, "forever" until a
--                 resume; a pause whose until has passed is over;
--   shifted       how far the pause has moved the layers' queues so far;
--   src           who set the pause's end: "provider" or "operator";
--   resume        after an outage, the instant (us) the fleet leaves its
--                 local shares: no take is granted before it;
--   a:<sfx>, ev   the timeline of the layer whose key ends in sfx (""
--                 for the first), and how many times a timeline moved
--                 (see timeline.lua);
--   pmax          the highest priority class that took from the bucket;
--   t<c>:<sfx>    class c's tail in the layer whose key ends in sfx, for
--                 c = 1 ... pmax; p<c>:<sfx>, how far takes of higher
--                 classes have pushed class c's grants in that layer, for
--                 c = 0 ... pmax-1; pt, when the latest push was;
--                 q<c>:<sfx>, class c's push clock (see classes.lua);
--   fv, f:<tenant>
--                 the virtual time of the bucket's tenants, and each
--                 tenant's "<finish> <weight> <waiting until> <asked
--                 last>" (see tenants.lua);
--   seen          the first layer's Limit the Limiters last passed,
--                 "<rate> <burst>"; layers, the further layers' key
--                 suffixes; u:<id>, a Limiter that used the bucket lately,
--                 until when (ms); users, how many u: fields the last
--                 sweep left (see record.lua).
--
-- Every script's KEYS begin with the layers' keys, KEYS[1..k], the first
-- layer's being the bucket's key, then the control record, KEYS[k+1]; an
-- adjust names one more key after it (update.lua). Every script's ARGV
-- begin alike:
-- ARGV[1]  the operation, which also names the call in MONITOR and the
--          slow log;
-- ARGV[2]  now in microseconds, or "" to use the server's clock (TIME);
-- ARGV[3]  uses: what the call uses beyond the core, "plain" for
--          nothing, "class" for priority classes, "tenant" for tenants
--          (and classes).
--
-- The scripts run on Redis's one thread, on every request, and a function
-- costs the call that makes it whether or not it runs (more so for each
-- local of the script it reads): each part makes its functions only for
-- the calls that may need them (a bucket whose record says so, a call
-- that uses them, a kind of call), so that a take that uses nothing
-- beyond the core makes none.

local op = ARGV[1]
local now = clock(ARGV[2]) -- the prelude's (internal/redisx)
local uses = ARGV[3]
local k = #KEYS - 1
if op == 'adjust' then
  k = k - 1 -- its settles' key follows the record's
end
local ctl = KEYS[k + 1]

-- The pause, the override and the resume, as every operation needs them.
-- (A field is converted only when the record holds it, false otherwise:
-- most hold none of them, and each conversion is a call.)
local f = redis.call('HMGET', ctl, 'since', 'until', 'shifted', 'rate', 'burst', 'resume', 'pmax')
local since, untilv, shifted = f[1] and tonumber(f[1]) or nil, f[2], f[3] and tonumber(f[3]) or 0
-- After an outage, the instant the fleet leaves its local shares
-- (resuming): until then no take is granted, whether or not its Limiter
-- saw the outage.
local resuming = f[6] and tonumber(f[6]) or nil
resuming = resuming ~= nil and resuming > now
local forever = untilv == 'forever'
local ends = untilv and tonumber(untilv) or nil -- nil while forever
local paused = since ~= nil and (forever or ends > now)
local pmax = f[7] and tonumber(f[7]) or 0

-- The layers: tats[i], rates[i] and fulls[i], the µs layer i takes to
-- fill from empty. Times are in microseconds; tokens accrue in layer i at
-- rates[i] a second, so t tokens take t / rate * 1000000 (dividing first
-- keeps extreme rates finite). Work relative to now: the absolute times
-- are too large for the fractions of a microsecond to survive the
-- arithmetic.
--
-- Every script's last 2k ARGV are the layers' Limits, layer i's rate
-- (tokens a second, > 0) and then its burst (the tokens it holds); ""
-- for a Limit the caller does not know (a record operation), which the
-- record tells for the first layer ("seen") and the key for the others.
-- The first layer computes with the override when there is one (unless
-- KEYS[1] is a further layer's, updated alone after an outage). A layer
-- whose Limit is not known is left as it is.
local tats, rates, fulls = {}, {}, {}
local limits = #ARGV - 2 * k -- layer i's rate is ARGV[limits + 2i - 1], its burst ARGV[limits + 2i]
for i = 1, k do
  local state = redis.call('GET', KEYS[i])
  local tat = tonumber(state)
  if not tat then
    if state then
      return redis.error_reply('quota: ' .. KEYS[i] .. ' holds something other than a bucket')
    end
    tat = now
  end
  tats[i] = tat
  local rate, burst = ARGV[limits + 2 * i - 1], ARGV[limits + 2 * i]
  if i == 1 and f[4] and f[5] and ctl == KEYS[1] .. ':ctl' then
    rate, burst = f[4], f[5]
  elseif rate == '' and i == 1 then
    rate, burst = string.match(redis.call('HGET', ctl, 'seen') or '', '^(%S+) (%S+)$')
  elseif rate == '' then
    rate, burst = string.match(KEYS[i], ':([^:/]+)/([^:/]+)$')
  end
  rate, burst = tonumber(rate), tonumber(burst)
  if rate and burst and rate > 0 then
    rates[i], fulls[i] = rate, burst / rate * 1000000
  end
end

-- The functions of the core are made for every call but a take that uses
-- nothing beyond it (a plain take on a bucket no class took from), which
-- makes no function at all (see script.lua).
local write, sfx, expire
local keep = 10000 -- ms, the least the record is kept
if op ~= 'take' or uses ~= 'plain' or pmax > 0 then
  -- write sets layer i's tat to v, or deletes its key when v has passed.
  -- While a pause with no end is in force, a layer that owes anything
  -- beyond the pause's origin keeps it until the resume moves it: its key
  -- does not expire meanwhile. A layer key expires when its layer is full
  -- again: an absent key and a full layer are the same state, so idle
  -- buckets cost no memory.
  function write(i, v)
    if forever and paused and v > since + shifted then
      redis.call('SET', KEYS[i], v)
    elseif v <= now then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
    end
  end

  -- sfx returns the suffix of layer i's key after the bucket's, which
  -- names the layer in the record's fields ("" for the first).
  function sfx(i)
    return string.sub(KEYS[i], #KEYS[1] + 1)
  end

  -- expire keeps the record while it holds an override or a pause with
  -- no end, and otherwise for as long as its pause or its layers' keys,
  -- and keep at least.
  function expire()
    local g = redis.call('HMGET', ctl, 'rate', 'until')
    if g[1] or g[2] == 'forever' then
      redis.call('PERSIST', ctl)
      return
    end
    local ttl = keep
    if g[2] then
      ttl = math.max(ttl, math.ceil((tonumber(g[2]) - now) / 1000))
    end
    for i = 1, k do
      ttl = math.max(ttl, redis.call('PTTL', KEYS[i]))
    end
    redis.call('PEXPIRE', ctl, ttl)
  end
end
