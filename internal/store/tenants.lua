-- quota's bucket scripts, continued (see core.lua): tenants.
--
-- Tenants. A take may name the tenant it is for, with the tenant's
-- weight: on a bucket whose queue is full, each tenant with takes waiting
-- gets rate x weight / (the waiting tenants' weights), and a tenant that
-- waits for nothing leaves its share to the others. The script keeps the
-- bucket's queue short for such takes, and decides who joins it:
--
-- * Start-time fair queueing. A tenant's next take starts, in virtual
--   time, where its last one finished or, for a tenant that has not asked
--   lately, where the bucket's virtual time stands if that is later; it
--   finishes its cost (µs of the slowest layer's rate) / weight later.
--   The bucket's virtual time (fv) is the latest start of a take it
--   admitted. A take is admitted when no
--   other waiting tenant would start before it, and then only while the
--   bucket's queue, with it, is at most fairQueue long: the grants
--   already given out, which nobody can take back, are never more than
--   that, so that a tenant that stops leaves its share to the others
--   within fairQueue.
-- * A take that is not admitted takes nothing and is held (script.lua),
--   with how long until it may be (its turn, or room in the queue), at
--   most fairNap: its caller sleeps that long, and up to half as long
--   again, and asks again. Meanwhile its tenant counts as waiting: until
--   its caller is due back, with room for the jitter and the call. So
--   does a tenant admitted into a queue with no room for its next take,
--   until there is: the Limiter's next caller of the tenant asks then.
-- * The oldest held take of a tenant holds its ticket: no take of the
--   tenant first held later, or not at all, is admitted before it, until
--   it is, or its caller is due back and has not asked. A take is as old
--   as the server's time when it was first held, which its caller sends
--   when it asks again. Without it, a held take that asks again after its
--   sleep would find each place that frees taken by the same tenant's
--   takes from other Limiters, which ask the moment it frees, and a
--   larger take by smaller ones, for ever. With it, the oldest take waits
--   only for its tenant's turn and room.
-- * A take of a priority above 0 is not held: its tenant is charged what
--   it takes, as if admitted, and so waits that much longer for its next
--   take of priority 0.
-- * A settle (adjust) charges its tenant what its take is now reckoned
--   to have cost more, or gives back what it cost less: the shares are
--   of what the tenants used, not of what they reserved.
--
-- Each tenant is a field of the record, f:<tenant> = "<finish> <weight>
-- <waiting until> <asked last> <ticket's take first held> <ticket's take
-- back at> <ticket until> <granted>", the ticket's 0 0 0 for none, granted
-- the first layer's tokens it was granted since the field was made; one that waits
-- for nothing, has not asked for fairActive, has no ticket and whose
-- finish the virtual time has passed is as if absent, and is removed. A take names
-- the most tenants the bucket keeps apart: a tenant not among them when
-- as many are takes as the tenant "" (the others), unless its cap is 0 (a
-- tenant the Limiters list by name).
local fairQueue = 250000 -- µs
local fairNap = 250000 -- µs
local fairActive = 500000 -- µs a tenant that asked keeps a finish behind fv
local fair -- {v, t = {tenant = {f, w, due, seen, k, kb, ku}}, n, gone, dirty}, read by loadFair
local loadFair, saveFair, tenantOf, weigh, start, admit, charge
-- They are made for a call that names a tenant (core.lua's uses).
if uses == 'tenant' then
  function loadFair()
    if fair then
      return
    end
    fair = {v = 0, t = {}, n = 0, gone = {}}
    local h = redis.call('HGETALL', ctl)
    for i = 1, #h, 2 do
      if h[i] == 'fv' then
        fair.v = tonumber(h[i + 1]) or 0
      end
    end
    for i = 1, #h, 2 do
      if string.sub(h[i], 1, 2) == 'f:' then
        local fin, w, due, seen, k, kb, ku, g = string.match(h[i + 1], '^(%S+) (%S+) (%S+) (%S+) ?(%d*) ?(%d*) ?(%d*) ?(%S*)$')
        fin, w, due, seen = tonumber(fin), tonumber(w), tonumber(due), tonumber(seen)
        k, kb, ku = tonumber(k) or 0, tonumber(kb) or 0, tonumber(ku) or 0
        if fin and w and due and seen and (fin > fair.v or due >= now or seen + fairActive >= now or ku >= now) then
          fair.t[string.sub(h[i], 3)] = {f = fin, w = w, due = due, seen = seen, k = k, kb = kb, ku = ku, g = tonumber(g) or 0}
          fair.n = fair.n + 1
        else
          fair.gone[#fair.gone + 1] = h[i]
        end
      end
    end
    fair.dirty = #fair.gone > 0
  end
  -- saveFair writes the tenants back.
  function saveFair()
    if not (fair and fair.dirty) then
      return
    end
    if #fair.gone > 0 then
      redis.call('HDEL', ctl, unpack(fair.gone))
    end
    local h = {'fv', string.format('%.3f', fair.v)}
    for name, e in pairs(fair.t) do
      if e.dirty then
        h[#h + 1], h[#h + 2] = 'f:' .. name, string.format('%.3f %s %d %d %d %d %d %.17g', e.f, e.w, e.due, e.seen, e.k, e.kb, e.ku, e.g)
      end
    end
    redis.call('HSET', ctl, unpack(h))
  end
  -- tenantOf returns the tenant entry a take names, made if need be.
  function tenantOf(name, weight, cap)
    loadFair()
    local e = fair.t[name]
    if not e and cap > 0 and fair.n >= cap then
      name = ''
      e = fair.t[name]
    end
    if not e then
      e = {f = -math.huge, w = weight, due = 0, seen = 0, k = 0, kb = 0, ku = 0, g = 0}
      fair.t[name], fair.n = e, fair.n + 1
    end
    e.w = weight
    return e
  end
  -- weigh checks the weights of a take's callers, each in stride ARGV
  -- (see script.lua), and returns the error reply of the first that is
  -- not one. The tenants a batch names all ask now: each waits, for the
  -- turns of those served before it in the batch.
  function weigh(callers, stride)
    for c = 1, callers do
      local x = 5 + (c - 1) * stride
      local w = tonumber(ARGV[x + 4])
      if not w or w < 0 or w == math.huge or w ~= w then
        return redis.error_reply('quota: a take for a tenant of weight ' .. tostring(ARGV[x + 4]))
      end
      if callers > 1 and w > 0 and tonumber(ARGV[x + 1]) == 0 then
        local e = tenantOf(ARGV[x + 3], w, tonumber(ARGV[x + 5]))
        e.due = math.max(e.due, now)
      end
    end
  end
  -- start returns where the tenant e's next take starts in virtual time:
  -- where its last one finished, or where the virtual time stands when
  -- that is later and the tenant has not asked for fairActive (a tenant
  -- that keeps asking keeps what its settles gave back, one that comes
  -- back does not).
  function start(e)
    if e.seen + fairActive >= now then
      return e.f
    end
    return math.max(e.f, fair.v)
  end
  -- admit decides whether a take of priority 0 that costs c (µs) for the
  -- tenant e, whose wait would be wait (µs) and which was first held at
  -- since (0: never), is admitted now; when it is not, it also returns
  -- how long until it may be.
  function admit(e, c, wait, since)
    local s = start(e)
    local turn, ahead = true, 0
    for _, o in pairs(fair.t) do
      if o ~= e and o.due >= now then
        local so = start(o)
        if so < s then
          turn, ahead = false, ahead + o.w * (s - so)
        end
      end
    end
    local mine = since > 0 and since or now
    local behind = e.ku >= now and e.k < mine -- an older take's ticket
    if turn and wait <= fairQueue and not behind then
      if e.k == mine then
        e.k, e.kb, e.ku, e.dirty, fair.dirty = 0, 0, 0, true, true
      end
      return true
    end
    -- Room in the queue comes at the rate: the take is due when the queue
    -- has room and the tenants ahead of it have had theirs; behind an
    -- older take, no sooner than that take is back, nor than a tenth of
    -- fairNap, not to spin while it is late.
    local retry = math.max(wait - fairQueue, 0) + ahead
    if behind then
      retry = math.max(retry, e.kb - now, fairNap / 10)
    end
    retry = math.max(math.min(math.ceil(retry), fairNap), 1000)
    local due = now + math.ceil(retry * 1.5) + 100000
    if not behind then
      e.k, e.kb, e.ku = mine, now + retry, due
    end
    e.f, e.due, e.seen, e.dirty, fair.dirty = s, due, now, true, true
    return false, retry
  end
  -- charge records that the tenant e took c (µs) at priority class, with a
  -- wait of wait (µs). A tenant whose next take would find the queue full
  -- is saturating the bucket: it counts as waiting until that take would
  -- find room, and the time to ask, as the Limiters ask it then (see
  -- admit).
  function charge(e, c, class, wait)
    local s = start(e)
    if class == 0 then
      fair.v, e.due = math.max(fair.v, s), 0
      if wait > 0 then
        e.due = now + math.max(wait + c - fairQueue, 0) + 100000
      end
    end
    e.f, e.seen, e.dirty, fair.dirty = s + c / e.w, now, true, true
  end
end
