-- quota's bucket scripts, continued (see core.lua): priority classes and
-- their minimum shares.
--
-- Priority classes. A take may name a class, 1 to 7; one that names none
-- is class 0. A take of class c is served before every grant of a lower
-- class that is not yet due: it queues behind the classes c and above
-- alone, and pushes the grants of the classes below it back by what it
-- takes. Each class keeps its tail in each layer (t<c>:<sfx>, beside the
-- layer's own tat, which is class 0's and counts every class), so that
-- from the commit point on a layer's queue runs from the highest class to
-- the lowest, first come first served within each.
--
-- A grant due within commit of now stands: its caller may be about to
-- send, and an announcement would not reach it in time. So a take of
-- class c finds the queue of the classes below it committed up to
-- now + commit (in tat terms, now + the layer's full time + commit), and
-- the grants of those classes due later are what it pushes: it adds what
-- it takes to their classes' push counts (p<c>:<sfx>), announces them,
-- and their callers asleep fall due that much later, those whose grants
-- were due more than commit after the push (control.CommitHorizon, which
-- the Limiters use to tell). A grant that straddles the commit point has
-- the tokens before it already; it is pushed as a whole, since its last
-- token is what it waits for. The grants of the classes c and above, and
-- of class 0 when no higher class is queued, are as before.
--
-- Minimum shares. A class may be given a share of the rate that the
-- classes above it cannot take from it: the takes that name a class list
-- the shares of the classes below it. Pushes of a class j whose share is
-- m move its queue by at most 1 - m of the time that passes, so that its
-- grants fall due at m of the rate or more: each layer of the class keeps
-- a push clock (q<j>:<sfx>), which a push of d moves d / (1 - m) on from
-- where it stood, or from commit before now if that is later. While the
-- clock is ahead of now, a take of a higher class that would push the
-- class is refused with how long until the clock is back to now: the
-- share's time is class j's, and a caller of a higher class that queued
-- behind it would take from it.
local commit = 100000 -- µs
-- tails[c][i], c = 1 ... pmax, and pushes[c][i], c = 0 ... pmax - 1, are
-- read when an operation first needs them; nil: none (read them with
-- loadClasses first). clocks: the push clocks read or moved so far, by
-- field.
local tails, pushes, clocks
local classesDirty = false
local loadClasses, clockField, pushClock, rank, moveTails, saveClasses, pushList, push, announcePushes
-- They are made for a call on a bucket that priority classes took from,
-- or one that uses them (core.lua's uses): a call that needs none makes
-- none.
if pmax > 0 or uses ~= 'plain' then
  clocks = {}
  -- loadClasses reads the tails and push counts, and makes room for the
  -- classes up to upto.
  function loadClasses(upto)
    if not tails then
      tails, pushes = {}, {}
      for c = 0, pmax do
        tails[c], pushes[c] = {}, {}
        for i = 1, k do
          if c > 0 then
            tails[c][i] = tonumber(redis.call('HGET', ctl, 't' .. c .. ':' .. sfx(i)))
          end
          if c < pmax then
            pushes[c][i] = tonumber(redis.call('HGET', ctl, 'p' .. c .. ':' .. sfx(i))) or 0
          end
        end
      end
    end
    for c = pmax + 1, upto do
      tails[c] = {}
      pushes[c - 1] = pushes[c - 1] or {}
      for i = 1, k do
        pushes[c - 1][i] = pushes[c - 1][i] or 0
      end
      pmax, classesDirty = c, true
    end
  end
  function clockField(c, i)
    return 'q' .. c .. ':' .. sfx(i)
  end
  -- pushClock returns the push clock of class c in layer i (see Minimum
  -- shares).
  function pushClock(c, i)
    local field = clockField(c, i)
    if not clocks[field] then
      clocks[field] = tonumber(redis.call('HGET', ctl, field)) or -math.huge
    end
    return math.max(clocks[field], now - commit)
  end
  -- rank places a take of class c, above 0, that takes n[i] from layer
  -- i of the layers' queue (script.lua's queue): it reads the minimum
  -- shares of the classes below c from list (a take's, see script.lua)
  -- and returns them, shares[j] class j's; how long the take waits for
  -- the push clock of a class whose share it would push past to be back
  -- to now (crowded, -math.huge for none; see Minimum shares); and
  -- from[i], where the take queues in layer i, as a tat: behind the
  -- classes at and above its own, and what is committed. (A take of class
  -- 0 queues behind every class, at the layers' queue.)
  function rank(c, list, n, queue)
    loadClasses(c)
    local shares, j = {}, 0
    for m in string.gmatch(list, '%S+') do
      if j < c then
        shares[j] = tonumber(m)
      end
      j = j + 1
    end
    local crowded = -math.huge
    for j = 0, c - 1 do
      local m = shares[j]
      if m and m > 0 and m < 1 then
        for i = 1, k do
          local t = queue[i]
          if j > 0 then
            t = tails[j][i] or now
          end
          if n[i] > 0 and t > now + fulls[i] + commit then
            crowded = math.max(crowded, pushClock(j, i) - now)
          end
        end
      end
    end
    local from = {}
    for i = 1, k do
      from[i] = math.max(tails[c][i] or now, math.min(queue[i], now + fulls[i] + commit))
    end
    return shares, crowded, from
  end
  -- moveTails sets each tail of layer i to g(tail), as a pause or a
  -- give-back moves the layer's queue.
  function moveTails(i, g)
    loadClasses(0)
    for c = 1, pmax do
      local t = tails[c][i]
      if t then
        local v = g(t)
        if v ~= t then
          tails[c][i], classesDirty = v, true
        end
      end
    end
  end
  -- saveClasses writes the tails and push counts back, and the highest
  -- class, when they changed.
  function saveClasses()
    if not classesDirty then
      return
    end
    local h = {'pmax', pmax}
    for c = 0, pmax do
      for i = 1, k do
        if c > 0 and tails[c][i] then
          h[#h + 1], h[#h + 2] = 't' .. c .. ':' .. sfx(i), string.format('%d', math.ceil(tails[c][i]))
        end
        if c < pmax then
          h[#h + 1], h[#h + 2] = 'p' .. c .. ':' .. sfx(i), string.format('%d', math.floor(pushes[c][i] + 0.5))
        end
      end
    end
    for field, v in pairs(clocks) do
      if v > -math.huge then
        h[#h + 1], h[#h + 2] = field, string.format('%d', math.ceil(v))
      end
    end
    redis.call('HSET', ctl, unpack(h))
  end
  -- push takes d (µs at layer i's rate) for a take of class c that
  -- queues at from (a tat), from a layer whose queue, q, runs past the
  -- commit point: the grants of each lower class due past it move d later,
  -- which its count adds in positions (d / scale), and so do the push
  -- clocks of the classes with a minimum share (shares). It returns the
  -- take's tat and the layer's.
  function push(i, c, from, d, q, shares, scale)
    local v = math.max(from, now) + d
    for lower = 0, c - 1 do
      local t = q
      if lower > 0 then
        t = tails[lower][i] or now
      end
      if t > now + fulls[i] + commit then
        t = t + d
        pushes[lower][i] = pushes[lower][i] + d / scale
        local m = shares[lower]
        if m and m > 0 and m < 1 then
          clocks[clockField(lower, i)] = pushClock(lower, i) + d / (1 - m)
        end
      else
        t = math.max(t, v)
      end
      if lower == 0 then
        q = t
      else
        tails[lower][i] = t
      end
    end
    return v, q
  end
  -- announcePushes records when the latest push was, and announces the
  -- push counts on channel ("" for none): "p", when, each class's push
  -- counts in each layer as "<class>:<suffix>=<us>", a newline, then the
  -- bucket's key. The callers asleep in the lower classes go later.
  function announcePushes(channel)
    redis.call('HSET', ctl, 'pt', string.format('%d', now))
    if channel == '' then
      return
    end
    local parts = {'p', string.format('%d', now)}
    for lower = 0, pmax - 1 do
      for i = 1, k do
        parts[#parts + 1] = lower .. ':' .. sfx(i) .. '=' .. string.format('%d', math.floor(pushes[lower][i] + 0.5))
      end
    end
    -- pcall: the announcement, known only once the take is written, is
    -- lost rather than the take failed when the user may not publish;
    -- the sleepers read the record again in time.
    redis.pcall('PUBLISH', channel, table.concat(parts, ' ') .. '\n' .. KEYS[1])
  end
  -- pushList returns every class's push counts, class 0's first, k each.
  function pushList()
    local t = {}
    loadClasses(0)
    for c = 0, pmax - 1 do
      for i = 1, k do
        t[#t + 1] = math.floor(pushes[c][i] + 0.5)
      end
    end
    return t
  end
end
