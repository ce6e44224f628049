-- quota's bucket scripts, continued (see core.lua): the plain take.
--
-- The take as most calls make it: of the plain form, on a bucket of one
-- layer whose record holds nothing in force that changes a take (no pause,
-- no resume ahead, no override, no learned rate, no priority class that
-- took from it).
-- This part serves such a call whole, as script.lua would serve it (its
-- KEYS, ARGV and reply), without the layers' tables, the other parts'
-- functions and script.lua's generality, which cost each call more than
-- the take itself. Any other call, and one with an argument it does not
-- read as a number, goes on to layers.lua and script.lua: it has written
-- nothing by then.
if op == 'take' and uses == 'plain' and k == 1 and pmax == 0 and not (paused or resuming or forever or f[3] or f[6]) then
  local state = redis.call('GET', KEYS[1])
  local tat = state and tonumber(state) or not state and now
  local m = #ARGV
  local rate, burst = tonumber(ARGV[m - 1]), tonumber(ARGV[m])
  local callers = (m - 6) / 2 -- each its longest wait and its tokens
  if tat and rate and burst and rate > 0 and callers >= 1 and callers % 1 == 0 then
    local full, q, argv = burst / rate * 1000000, tat, ARGV -- q: the layer's tat as the takes leave it
    -- reply: made once a caller is not granted at once; a, ev: the
    -- layer's anchor and the timeline's count, read when first needed (see
    -- timeline.lua). A caller's ARGV are converted only where they differ
    -- from the caller's before it, as script.lua does.
    local reply, a, ev, maxWait, n, waits, ns
    for c = 1, callers do
      local w, t = argv[3 + 2 * c], argv[4 + 2 * c]
      if w ~= waits then
        waits, maxWait = w, tonumber(w)
      end
      if t ~= ns then
        ns, n = t, tonumber(t)
      end
      if not (maxWait and maxWait >= 0 and n and n >= 0) then
        reply = false -- script.lua replies the error
        break
      end
      local d = n / rate * 1000000
      local debt = q - now
      if debt < 0 then
        debt = 0
      end
      local longest, wait = debt + d - full, 0
      if longest > 0 and n > 0 then
        wait = math.floor(longest + 0.5)
      end
      if wait == 0 then -- granted at once
        if n > 0 then
          local v = q
          if now > v then
            v = now
          end
          v = v + d
          if v > q then
            q = v
          end
        end
        if reply then
          local o = (c - 1) * 4
          reply[o + 1], reply[o + 2], reply[o + 3], reply[o + 4] = 1, 0, 0, 0
        end
      else
        local o = (c - 1) * 4 -- where its reply begins
        if not reply then
          reply = {}
          for j = 1, o, 4 do -- the callers before it, all granted at once
            reply[j], reply[j + 1], reply[j + 2], reply[j + 3] = 1, 0, 0, 0
          end
        end
        if wait > maxWait then
          reply[o + 1], reply[o + 2], reply[o + 3], reply[o + 4] = 2, wait, math.floor(q), 0 -- too long
        else
          local v = q
          if now > v then
            v = now
          end
          v = v + d
          if v > q then
            q = v
          end
          if not a then
            local g = redis.call('HMGET', ctl, 'a:', 'ev')
            local at, pos, scale = string.match(g[1] or '', '^(%S+) (%S+) (%S+)$')
            a, ev = {at = tonumber(at) or 0, pos = tonumber(pos) or 0, scale = tonumber(scale) or 1}, g[2]
          end
          local vt = math.floor(v)
          reply[o + 1], reply[o + 2], reply[o + 3] = 1, wait, vt
          reply[o + 4] = math.floor(a.pos + math.max(vt - full - a.at, 0) / a.scale)
        end
      end
    end
    if reply ~= false then
      if q ~= tat then
        if q <= now then
          redis.call('DEL', KEYS[1])
        else
          -- As layers.lua's set (a function would cost this call more).
          local ms = (q - now) / 1000
          local px = ms - ms % 1
          if px < ms then
            px = px + 1
          end
          if q % 1 == 0 and q < 1e17 then
            redis.call('SET', KEYS[1], string.format('%d', q), 'PX', string.format('%d', px))
          else
            redis.call('SET', KEYS[1], q, 'PX', px)
          end
        end
      end
      if not reply then
        return 0
      end
      if not a then
        ev = redis.call('HGET', ctl, 'ev')
      end
      reply[#reply + 1] = tonumber(ev) or 0
      reply[#reply + 1] = now
      return reply
    end
  end
end
