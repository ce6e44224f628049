-- quota's bucket scripts, continued (see core.lua): the daily layers.
--
-- A daily layer holds a count, not a rate: n tokens a day, all given back
-- at once at a reset instant, a time of day in a zone. The script knows no
-- zones: its Limit's rate ARGV is the callers' spec (internal/daily),
-- "d<r1>,<r2>,<r3>,<r4>,<w>", four successive reset instants (µs), the
-- first at least an hour before the callers' now, and w, the µs a token
-- stands for (a power of two: n x w is at most half a day, shorter than
-- any day); its burst ARGV is n. Today is the day now falls in, between
-- r1 and r2 or between r2 and r3, on the server's clock.
--
-- Its key holds a number as every layer's does, e + u x w: the day that
-- ends at the reset e has counted u tokens (0 to n). A key read after its
-- day has ended tells nothing (it expires soon after). A take counts
-- against today when its grant falls due before today ends and today has
-- room, and otherwise against tomorrow, first come, first served: once a
-- take has gone to tomorrow, today is spent for the takes after it. None
-- goes further: a take that finds tomorrow spent too waits too long,
-- whatever its longest wait. A pause holds a daily grant as any (the take's
-- earliest, the anchors it moves) but leaves the counts as they are; a
-- refund or a settle gives back, or takes, within the day its count is in.
--
-- The other parts see a daily layer as a bucket frozen at now: its tat is
-- now + p x w, p the tokens counted from today's start (beyond n, today
-- is spent and tomorrow has counted p - n), a token w µs, full n x w.
-- set (layers.lua) writes such a tat back as the key holds it.
--
-- A record operation knows no Limits: it finds a further daily layer by
-- its key's name (internal/daily's Key), and a first one by its record's
-- "seen", where a Limiter writes that name and the count ("d0800@UTC 5";
-- a blank, from Limiters before it). Such a layer is true in days: a
-- pause leaves its count as it is, and the key as it was.
for i = 1, k do
  if not rates[i] then -- layers.lua reads a daily Limit as no Limit
    local spec = ARGV[limits + 2 * i - 1] or ''
    local a, b, c, d, w = string.match(spec, '^d(%d+),(%d+),(%d+),(%d+),(%d+)$')
    local n = tonumber(ARGV[limits + 2 * i])
    if spec == '' and (i > 1 and string.match(string.sub(KEYS[i], #KEYS[1] + 1), ':d%d+@[^:/]*/[^:/]+$')
        or i == 1 and string.match(redis.call('HGET', ctl, 'seen') or '', '^[d ]')) then
      days = days or {}
      days[i] = true
    elseif a and n and n > 0 then
      a, b, c, d, w = tonumber(a), tonumber(b), tonumber(c), tonumber(d), tonumber(w)
      if now < a or now >= c then
        return redis.error_reply('quota: daily layer ' .. i .. ': the clock (' .. string.format('%d', now) ..
          ' us) is a day or more from the callers\', whose resets begin at ' .. string.format('%d', a))
      end
      local e1, e2 = b, c -- when today, and tomorrow, end
      if now >= b then
        e1, e2 = c, d
      end
      local s, p = tats[i], 0
      if s >= e2 then
        p = n + (s - e2) / w
      elseif s >= e1 then
        p = (s - e1) / w
      end
      tats[i] = now + p * w
      rates[i], fulls[i], caps[i] = 1000000 / w, n * w, 1000000 / w
      days = days or {}
      days[i] = {e1 = e1, e2 = e2, w = w, n = n}
      days[KEYS[i]] = days[i]
    end
  end
end

local dayWait, dayTake, dayReply, dayUpdate
if days then
  -- dayStore returns tat v of the layer whose key is key as its key
  -- holds it (see set); v for a layer that is not daily.
  function dayStore(key, v)
    local d = days[key]
    if not d then
      return v
    end
    local p = (v - now) / d.w
    if p <= d.n then
      return d.e1 + p * d.w
    end
    return d.e2 + (p - d.n) * d.w
  end

  -- dayWait returns longest, the wait of a take of amounts[i] from each
  -- layer i whose queue ends at queue[i], as the daily layers make it:
  -- until today ends for one that goes to tomorrow, which may make
  -- another go too; beyond maxWait for one that tomorrow has no room for.
  function dayWait(amounts, queue, longest, maxWait)
    local moved = true
    while moved do
      moved = false
      for i = 1, k do
        local d = days[i]
        if d and amounts[i] > 0 then
          local p, a = (queue[i] - now) / d.w, amounts[i]
          if longest < d.e1 - now and p + a <= d.n then
            -- today
          elseif math.max(p, d.n) + a <= 2 * d.n then
            if longest < d.e1 - now then
              longest, moved = d.e1 - now, true
            end
          else
            return math.max(longest, d.e2 - now, maxWait + 1)
          end
        end
      end
    end
    return longest
  end

  -- dayTake moves queue[i], daily layer i's tat, by a grant of a tokens
  -- due after wait, and returns it: today's when it falls due before
  -- today ends and today has room (as dayWait found), else tomorrow's.
  function dayTake(i, queue, a, wait)
    local d, q = days[i], queue[i]
    if a <= 0 then
      return q
    end
    local p = (q - now) / d.w
    if now + wait < d.e1 and p + a <= d.n then
      q = q + a * d.w
    else
      q = now + (math.max(p, d.n) + a) * d.w
    end
    queue[i] = q
    return q
  end

  -- dayReply returns the tat that identifies a grant that left daily
  -- layer i at v, as its key holds it, and when the layer lets it go.
  function dayReply(i, v)
    local d = days[i]
    if v - now > d.n * d.w then
      return math.floor(dayStore(KEYS[i], v)), d.e1
    end
    return math.floor(dayStore(KEYS[i], v)), now
  end

  -- dayUpdate returns daily layer i's tat after op: a refund of a
  -- tokens of the take that left mark (as the key held it) gives back what
  -- no later take counts behind, if its day is not over; an adjust takes a
  -- more (a < 0: gives back, within the day its count is in), and then
  -- leaves at most mark, the tokens the provider says remain, if any;
  -- a lower leaves at most a.
  function dayUpdate(i, tat, a, mark)
    local d = days[i]
    local p = (tat - now) / d.w
    if op == 'refund' then
      local m = tonumber(mark) or 0
      if m < d.e1 then
        return tat -- a day that is over
      elseif m < d.e2 then
        m = (m - d.e1) / d.w
      else
        m = d.n + (m - d.e2) / d.w
      end
      if p >= m then
        p = p - math.max(a - (p - m), 0)
      end
    elseif op == 'adjust' then
      if a > 0 then
        p = math.min(p + a, 2 * d.n)
      elseif p > d.n then
        p = math.max(p + a, d.n)
      else
        p = math.max(p + a, 0)
      end
      mark = tonumber(mark)
      if mark and mark >= 0 and p < d.n - mark then
        p = d.n - mark
      end
    elseif op == 'lower' and p < d.n - a then
      p = d.n - a
    end
    return now + p * d.w
  end
end
