-- quota: a bucket in Redis, its token layers and its control record. This
-- is the core every script of the bucket shares, with layers.lua, which
-- reads the layers. Each script is the prelude (internal/redisx), this
-- core, the parts it needs and its own body, joined in that order
-- (internal/store's scripts.go), and is loaded as a script of its own:
--   script.lua  the take: core, plain, layers, daily, classes,
--               timeline, tenants, script;
--   update.lua  refund, probe, pause, lower, adjust, resuming and refuse:
--               core, layers, daily, classes, timeline, learn, tenants,
--               update;
--   record.lua  the control record's operations: core, layers, daily,
--               classes, timeline, learn, record.
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
-- all or nothing, with the wait of the slowest. A daily layer counts
-- tokens a day instead (see daily.lua).
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
--                 suffixes; meter, what the first layer meters when each
--                 meters its own; u:<id>, a Limiter that used the bucket
--                 lately, until when (ms), and the slots it holds
--                 lingering, if any; users, how many u: fields the
--                 last sweep left; h:<sfx>, what the layer granted in each
--                 of the last seconds (see record.lua's tally);
--   learn, l:<sfx>, m:<sfx>
--                 the rates the fleet learned of the provider's real
--                 limit, by layer (see learn.lua).
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
-- beyond the core makes none; and the commonest take, served by
-- plain.lua, reads nothing beyond what it needs.

local op = ARGV[1]
local now = clock(ARGV[2]) -- the prelude's (internal/redisx)
local uses = ARGV[3]
local k = #KEYS - 1
if op == 'adjust' then
  k = k - 1 -- its settles' key follows the record's
end
local ctl = KEYS[k + 1]

-- The pause, the override and the resume, as every operation needs them:
-- f[1] since, f[2] until, f[3] rate, f[4] resume, f[5] pmax, f[6] learn
-- (see learn.lua), false for a field the record does not hold. (A field is converted only when the
-- record holds it: most hold none of them, and each conversion is a call.
-- shifted, which only a pause in force uses, is read then, and so is the
-- override's burst, see layers.lua.)
local f = redis.call('HMGET', ctl, 'since', 'until', 'rate', 'resume', 'pmax', 'learn')
local since, ends, resuming, forever, paused -- nil: none
local untilv, shifted, pmax = f[2], 0, 0
if f[1] or untilv or f[4] or f[5] then
  since = f[1] and tonumber(f[1]) or nil
  -- After an outage, the instant the fleet leaves its local shares
  -- (resuming): until then no take is granted, whether or not its Limiter
  -- saw the outage.
  resuming = f[4] and tonumber(f[4]) or nil
  resuming = resuming ~= nil and resuming > now
  forever = untilv == 'forever'
  ends = untilv and tonumber(untilv) or nil -- nil while forever
  paused = since ~= nil and (forever or ends > now)
  if paused then
    shifted = tonumber(redis.call('HGET', ctl, 'shifted')) or 0
  end
  pmax = f[5] and tonumber(f[5]) or 0
end

