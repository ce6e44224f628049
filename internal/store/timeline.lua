-- quota's bucket scripts, continued (see core.lua): the timeline and the
-- pause.
--
-- The timeline. A grant, once given out, is moved by what happens to
-- its layer's queue before it falls due: a pause and its end, a change
-- of the Limit in force, a settle's give-back. Each layer keeps one
-- record of all of it, its anchor, a:<sfx> = "<at> <pos> <scale>": the
-- grant at position pos in the layer's queue falls due at at, and one at
-- a later position p at at + (p - pos) x scale; none falls due before
-- at. A position never changes once given: a take replies its grant's,
-- and a caller asleep on it, however many events happened since, finds
-- when it falls due from the anchor it read last (store.Anchor, which
-- TestTimelineAgreesWithTheScript checks against these scripts). An
-- absent anchor is "0 0 1": a position is then the instant itself. ev
-- counts the moves of the bucket's anchors, so that a Limiter can tell an
-- anchor read before a take from one read after it. A push (see
-- classes.lua) moves the grants of a class alone: its count is in
-- positions too.
--
-- anchorsOf returns the reader of the anchors of the layers whose keys
-- are keys, the first the bucket's, in the record ctl: anchor(i), layer
-- i's anchor, read when first needed, and position(i, t), the position
-- of a grant of layer i due at t; and the anchors read, by layer. It
-- reads none of the script's locals, which makes it cheap to make for a
-- call that may not need it: a take reads the anchors only when a caller
-- waits.
local function anchorsOf(keys, ctl)
  local anchors = {}
  local function anchor(i)
    local a = anchors[i]
    if not a then
      local field = 'a:' .. string.sub(keys[i], #keys[1] + 1)
      local at, pos, scale = string.match(redis.call('HGET', ctl, field) or '', '^(%S+) (%S+) (%S+)$')
      a = {at = tonumber(at) or 0, pos = tonumber(pos) or 0, scale = tonumber(scale) or 1}
      anchors[i] = a
    end
    return a
  end
  local function position(i, t)
    local a = anchor(i)
    return a.pos + math.max(t - a.at, 0) / a.scale
  end
  return anchor, position, anchors
end

-- What moves the timeline, and the pause, is made for the calls other
-- than the take, which moves neither.
local anchor, position, anchors
local reanchor, moveFrom, stretch, moveBack, saveTimeline, timeline
local origin, floor, pauseTo
if op ~= 'take' then
  anchor, position, anchors = anchorsOf(KEYS, ctl)
  -- reanchor makes t the anchor's instant, when t is later.
  function reanchor(a, i, t)
    if a.at < t then
      a.pos, a.at = position(i, t), t
    end
    a.moved = true
  end
  -- moveFrom moves the grants of layer i due at t or later by d (µs;
  -- sooner when d < 0), as a pause, or its end, does.
  function moveFrom(i, t, d)
    local a = anchor(i)
    reanchor(a, i, t)
    a.at = a.at + d
  end
  -- stretch moves the grants of layer i due after t x times as far from
  -- t, as a change of the layer's rate from r to r / x does.
  function stretch(i, t, x)
    local a = anchor(i)
    if a.at > t then
      a.at = t + (a.at - t) * x
    end
    reanchor(a, i, t)
    a.scale = a.scale * x
  end
  -- moveBack moves the grants of layer i d sooner (µs), as a give-back
  -- does: none before the anchor's instant, nor while a pause is in force
  -- before the point its shifts have moved the queues to (see origin).
  function moveBack(i, d)
    local a = anchor(i)
    if paused then
      reanchor(a, i, origin())
    end
    a.pos, a.moved = a.pos + d / a.scale, true
  end
  -- saveTimeline writes the anchors moved and counts the move; it returns
  -- the count, or nil when nothing moved.
  function saveTimeline()
    local h = {}
    for i, a in pairs(anchors) do
      if a.moved then
        h[#h + 1], h[#h + 2] = 'a:' .. sfx(i), string.format('%.0f %.3f %.17g', a.at, a.pos, a.scale)
      end
    end
    if #h == 0 then
      return nil
    end
    redis.call('HSET', ctl, unpack(h))
    return redis.call('HINCRBY', ctl, 'ev', 1)
  end
  -- timeline returns the anchors of the layers, "<at> <pos> <scale>"
  -- each, joined with ",".
  function timeline()
    local t = {}
    for i = 1, k do
      local a = anchor(i)
      t[i] = string.format('%.0f %.3f %.17g', a.at, a.pos, a.scale)
    end
    return table.concat(t, ',')
  end

  -- origin is the instant the layers are reckoned from: now, or while a
  -- pause is in force the point its shifts have moved the queues to (its
  -- end, or while it has none the end it had, or its start), before
  -- which nothing falls due.
  function origin()
    if paused then
      return since + shifted
    end
    return now
  end
  -- floor returns the earliest tat of layer i while a pause in force
  -- ends at ends: at its end the layer holds at most one token.
  function floor(i, v)
    if paused and ends and rates[i] and not (days and days[i]) then
      return math.max(v, ends + fulls[i] - math.min(1000000 / rates[i], fulls[i]))
    end
    return v
  end

  -- pauseTo makes the bucket grant nothing before e (microseconds; nil
  -- for until a resume), as src asks; a pause in force that ends later
  -- stays. It is the one place a pause moves the queue: the layers'
  -- queues move in one piece, keeping their order and spacing, so that a
  -- grant due t after the pause began falls due t after it ends, and at
  -- the end each layer holds at most one token. A pause with no end
  -- moves nothing until it ends, and keeps what the layers owe;
  -- meanwhile every take is refused. resume ends a pause at now, e being
  -- now, and moves the queues by what the pause lasted beyond the shifts
  -- already made. It returns whether anything changed.
  function pauseTo(e, src, resume)
    if resume then
      if not paused then
        return false
      end
    elseif not paused then
      since, shifted = now, 0
    elseif forever or (e and e <= ends) then
      return false
    end
    local from = since + shifted -- where the queues stand moved to
    ends, forever, paused = e, e == nil, true
    for i = 1, k do
      local tat = tats[i]
      local v = tat
      if e then
        moveFrom(i, from, e - from)
        if tat > from and not (days and days[i]) then -- a daily layer keeps its counts
          v = tat + e - from
        end
      end
      v = floor(i, v)
      if v ~= tat or (not e and tat > from) then
        write(i, v)
        tats[i] = v
      end
      if pmax > 0 then
        moveTails(i, function(t)
          if e and t > from then
            t = t + e - from
          end
          return floor(i, t)
        end)
      end
    end
    if classesDirty then
      saveClasses()
    end
    saveTimeline()
    if e then
      shifted = e - since
    end
    redis.call('HSET', ctl, 'since', string.format('%d', since), 'until', e and string.format('%d', e) or 'forever',
      'shifted', string.format('%d', shifted), 'src', src)
    return true
  end
end
