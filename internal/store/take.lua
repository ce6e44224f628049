-- quota's bucket script, continued (see script.lua): the take.
-- The script runs on every request, on Redis's one thread, so the takes
-- keep to plain arithmetic on locals. Times are in microseconds; tokens
-- accrue in layer i at rates[i] a second, so t tokens take t / rate *
-- 1000000 (dividing first keeps extreme rates finite). Work relative to
-- now: the absolute times are too large for the fractions of a
-- microsecond to survive the arithmetic.
if op == 'take' then
  -- A take's outcome, the first integer of each caller's reply.
  local GRANTED, TOO_LONG, PAUSED, RESUMING, CROWDED, HELD = 1, 2, 3, 4, 5, 6
  local tats = {}
  for i = 1, k do
    tats[i] = r[i + 2]
  end
  local callers = (#ARGV - 3 * k - 2) / 2
  local channel -- announces the pushes (see classes)
  if callers ~= math.floor(callers) then
    callers = math.floor(callers)
    channel = ARGV[#ARGV]
  end
  local reply, waited, pushed = {}, false, false
  if callers > 1 then
    -- The tenants a batch names all ask now: each waits, for the turns of
    -- those served before it in the batch (see tenants).
    for c = 1, callers do
      local x = 2
      if c > 1 then
        x = 3 * k + 2 * c + 1
      end
      local arg, t = tenantArg(ARGV[x])
      if arg and t and not string.find(arg, '@', 1, true) then
        local e = tenantOf(t.name, t.w, t.cap)
        e.due = math.max(e.due, now)
      end
    end
  end
  for c = 1, callers do
    local x = 2 -- where caller c's n is, its longest wait after it
    if c > 1 then
      x = 3 * k + 2 * c + 1
    end
    local arg, tenant = tenantArg(ARGV[x])
    if not arg then
      return tenant
    elseif tenant then
      tenant = tenantOf(tenant.name, tenant.w, tenant.cap) -- its entry (see tenants)
    end
    local need = tonumber(arg)
    local each -- one amount per layer, when need is none
    local class = 0
    local shares = {} -- shares[j]: class j's minimum share, for j below class
    if not need then
      local amount, p, listed = string.match(arg, '^([^@]*)@([1-7])([0-9.:]*)$')
      if amount then
        class = tonumber(p)
        loadClasses(class)
        local j = 0
        for m in string.gmatch(listed, ':([0-9.]+)') do
          if j < class then
            shares[j] = tonumber(m)
          end
          j = j + 1
        end
      else
        amount = arg
      end
      need = tonumber(amount)
      if not need then
        each = amounts(amount)
      end
      if not need and not each then
        return redis.error_reply('quota: a take of ' .. tostring(arg) .. ' from ' .. k .. ' layers')
      end
    end
    -- A take that would push a class past its minimum share waits until
    -- the class's push clock is back to now (see shares).
    local crowded = -math.huge
    for j = 0, class - 1 do
      local m = shares[j]
      if m and m > 0 and m < 1 then
        for i = 1, k do
          local t = tats[i]
          if j > 0 then
            t = tails[j][i] or now
          end
          if (need or each[i]) > 0 and t > now + fulls[i] + commit then
            crowded = math.max(crowded, clock(j, i) - now)
          end
        end
      end
    end
    -- from[i]: where the take queues in layer i, as a tat: behind every
    -- class for class 0; behind the classes at and above its own, and what
    -- is committed, for a higher class.
    local from = {}
    for i = 1, k do
      from[i] = tats[i]
      if class > 0 then
        from[i] = math.max(tails[class][i] or now, math.min(tats[i], now + fulls[i] + commit))
      end
    end
    local longest = -math.huge
    if paused and ends then
      longest = ends - now -- nothing falls due before the pause ends
    end
    for i = 1, k do
      local debt = from[i] - now -- refill already promised beyond now
      if debt < 0 then
        debt = 0
      end
      local n = need or each[i]
      local wait = debt + n / rates[i] * 1000000 - fulls[i]
      if wait > longest and n > 0 then -- a layer asked nothing is no bar
        longest = wait
      end
    end
    local wait = math.floor(longest + 0.5)
    local o = #reply
    -- cost: the take's time at the slowest layer's rate, what its tenant
    -- is charged (see tenants).
    local cost, admitted, retry = 0, true, 0
    if tenant then
      for i = 1, k do
        cost = math.max(cost, (need or each[i]) / rates[i] * 1000000)
      end
      if class == 0 and not (forever or resuming) and wait <= tonumber(ARGV[x + 1]) then
        admitted, retry = admit(tenant, cost, wait)
      end
    end
    if not admitted then
      reply[o + 1], reply[o + 2], waited = HELD, retry, true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    elseif crowded > 0 and not (forever or resuming) then
      reply[o + 1], reply[o + 2], waited = CROWDED, math.ceil(crowded), true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    elseif forever or resuming or wait > tonumber(ARGV[x + 1]) then
      local outcome = TOO_LONG
      if resuming then
        outcome, wait = RESUMING, 0
      elseif forever then
        outcome, wait = PAUSED, 0
      end
      reply[o + 1], reply[o + 2], waited = outcome, wait, true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    else
      -- Every layer gives its tokens when the slowest does: a layer that
      -- could give them sooner counts them from then, as if taken then;
      -- but a layer whose lower classes the take pushes takes them where
      -- it queues, the commit point, which the pushes are reckoned from.
      local at = now
      if longest > 0 then
        at = now + longest
      else
        wait = 0
      end
      if tenant then
        charge(tenant, cost, class, wait)
      end
      reply[o + 1], reply[o + 2], waited = GRANTED, wait, waited or wait ~= 0
      for i = 1, k do
        local n = need or each[i]
        local v = from[i]
        if n > 0 then
          local d = n / rates[i] * 1000000
          if class > 0 and tats[i] > now + fulls[i] + commit then
            v = math.max(from[i], now) + d
            for lower = 0, class - 1 do
              local t = tats[i]
              if lower > 0 then
                t = tails[lower][i] or now
              end
              if t > now + fulls[i] + commit then
                t = t + d
                pushes[lower][i], pushed = pushes[lower][i] + d / anchor(i).scale, true
                local m = shares[lower]
                if m and m > 0 and m < 1 then
                  clocks[clockField(lower, i)] = clock(lower, i) + d / (1 - m)
                end
              else
                t = math.max(t, v)
              end
              if lower == 0 then
                tats[i] = t
              else
                tails[lower][i] = t
              end
            end
          else
            v = math.max(from[i], at) + d
            tats[i] = math.max(tats[i], v)
            for lower = 1, class - 1 do
              tails[lower][i] = v
            end
          end
          if class > 0 then
            tails[class][i], classesDirty = v, true
          end
        end
        reply[o + 2 + i] = math.floor(v)
      end
    end
    -- The grant's position in each layer (see timeline), for a caller
    -- that sleeps on it; 0 for one that does not.
    for i = 1, k do
      local p = 0
      if reply[o + 1] == GRANTED and reply[o + 2] ~= 0 then
        p = math.floor(position(i, reply[o + 2 + i] - fulls[i]))
      end
      reply[o + 2 + k + i] = p
    end
  end
  for i = 1, k do
    if tats[i] ~= r[i + 2] then
      write(i, tats[i])
    end
  end
  if fair and fair.dirty then
    saveFair()
    if not classesDirty then
      expire()
    end
  end
  if classesDirty then
    saveClasses()
    if pushed then
      redis.call('HSET', ctl, 'pt', string.format('%d', now))
      if channel and channel ~= '' then
        -- "p", when, each class's push counts in each layer as
        -- "<class>:<suffix>=<us>", a newline, then the bucket's key: the
        -- callers asleep in the lower classes go later.
        local parts = {'p', string.format('%d', now)}
        for lower = 0, pmax - 1 do
          for i = 1, k do
            parts[#parts + 1] = lower .. ':' .. sfx(i) .. '=' .. string.format('%d', math.floor(pushes[lower][i] + 0.5))
          end
        end
        -- pcall: the announcement, known only once the take is
        -- written, is lost rather than the take failed when the user may
        -- not publish; the sleepers read the record again in time.
        redis.pcall('PUBLISH', channel, table.concat(parts, ' ') .. '\n' .. KEYS[1])
      end
    end
    expire()
  end
  if waited then
    -- The timeline's count the takes found, for the callers that sleep on
    -- their grants (see timeline).
    reply[#reply + 1] = tonumber(redis.call('HGET', ctl, 'ev')) or 0
    reply[#reply + 1] = now
    for _, v in ipairs(pushList()) do
      reply[#reply + 1] = v
    end
    return reply
  end
  return 0
end
