-- quota's bucket script, continued (see script.lua): priority classes and their minimum shares.
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
local pmax = tonumber(f[8]) or 0
local function sfx(i)
  return string.sub(KEYS[i], #KEYS[1] + 1)
end
-- tails[c][i], c = 1 ... pmax, and pushes[c][i], c = 0 ... pmax - 1, are
-- read when an operation first needs them; nil: none (read them with
-- loadClasses first).
local tails, pushes
local classesDirty = false
-- clocks: the push clocks read or moved so far, by field (see shares).
local clocks = {}
local function clockField(c, i)
  return 'q' .. c .. ':' .. sfx(i)
end
local function clock(c, i)
  local field = clockField(c, i)
  if not clocks[field] then
    clocks[field] = tonumber(redis.call('HGET', ctl, field)) or -math.huge
  end
  return math.max(clocks[field], now - commit)
end
local function loadClasses(upto)
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
-- moveTails sets each tail of layer i to g(tail), as a pause or a
-- give-back moves the layer's queue.
local function moveTails(i, g)
  if pmax == 0 then
    return
  end
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
-- saveClasses writes the tails and push counts back, and the highest class.
local function saveClasses()
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
-- pushList returns every class's push counts, class 0's first, k each.
local function pushList()
  local t = {}
  if pmax == 0 then
    return t
  end
  loadClasses(0)
  for c = 0, pmax - 1 do
    for i = 1, k do
      t[#t + 1] = math.floor(pushes[c][i] + 0.5)
    end
  end
  return t
end
