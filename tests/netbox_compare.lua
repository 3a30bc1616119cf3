-- Tarantool's own client (net.box) against a server: `tarantool netbox_compare.lua HOST:PORT USER
-- PASSWORD`. Every request's result (or error code and message) is printed as one JSON line, so
-- the output of a run against sluice can be compared line for line with a run against Tarantool.
-- Expects the spaces of tests/tarantool_peer.py (users: id/name/age, primary on id; events:
-- user_id/seq/kind/note, primary on user_id+seq), both empty.
local json = require('json')
local net_box = require('net.box')

local address, user, password = arg[1], arg[2], arg[3]

local function plain(value)
    -- Tuples (and tables of tuples) as plain Lua tables json can encode.
    if box.tuple.is(value) then
        return value:totable()
    end
    if type(value) == 'table' then
        local out = {}
        for i, v in ipairs(value) do
            out[i] = plain(v)
        end
        return out
    end
    return value
end

local function step(name, fn, ...)
    local ok, result = pcall(fn, ...)
    local line = {step = name}
    if ok then
        if result == nil then
            line.result = json.NULL
        else
            line.result = plain(result)
        end
    elseif type(result) == 'cdata' and result.code ~= nil then
        line.error = {code = result.code, message = result.message}
    else
        line.error = {message = tostring(result)}
    end
    print(json.encode(line))
end

local conn = net_box.connect(address, {user = user, password = password, wait_connected = true})
if not conn:is_connected() then
    print(json.encode({step = 'connect', error = {message = tostring(conn.error)}}))
    os.exit(1)
end
print(json.encode({step = 'connect', result = conn.state}))

local users = conn.space.users
local events = conn.space.events

step('ping', function() return conn:ping() end)

-- insert, and the errors a bad tuple gets
for _, t in ipairs({{1, 'ada', 30}, {2, 'bob', 25}, {3, 'cy', 40}, {5, 'eve', 22}, {7, 'gus', 61}}) do
    step('insert ' .. t[1], function() return users:insert(t) end)
end
step('insert duplicate', function() return users:insert({1, 'again', 1}) end)
step('insert wrong type', function() return users:insert({'x', 'y', 1}) end)
step('insert missing field', function() return users:insert({10}) end)
step('insert extra field', function() return users:insert({8, 'hal', 18, 'extra'}) end)

-- replace: a new key and an existing one
step('replace new', function() return users:replace({4, 'dan', 33}) end)
step('replace existing', function() return users:replace({2, 'bob', 26}) end)
step('replace wrong type', function() return users:replace({4, 'dan', 'old'}) end)

-- point reads
step('get 1', function() return users:get(1) end)
step('get missing', function() return users:get(99) end)
step('get wrong type', function() return users:get('one') end)

-- iterators, limits and offsets
step('select all', function() return users:select({}) end)
step('select eq', function() return users:select({3}) end)
step('select eq missing', function() return users:select({6}) end)
step('select all iterator', function() return users:select({}, {iterator = 'ALL'}) end)
step('select ge', function() return users:select({3}, {iterator = 'GE'}) end)
step('select gt', function() return users:select({3}, {iterator = 'GT'}) end)
step('select le', function() return users:select({3}, {iterator = 'LE'}) end)
step('select lt', function() return users:select({3}, {iterator = 'LT'}) end)
step('select req', function() return users:select({3}, {iterator = 'REQ'}) end)
step('select ge between keys', function() return users:select({6}, {iterator = 'GE'}) end)
step('select lt between keys', function() return users:select({6}, {iterator = 'LT'}) end)
step('select ge limit', function() return users:select({2}, {iterator = 'GE', limit = 2}) end)
step('select ge offset', function() return users:select({2}, {iterator = 'GE', offset = 2}) end)
step('select le limit offset', function() return users:select({7}, {iterator = 'LE', limit = 2, offset = 1}) end)
step('select limit 0', function() return users:select({}, {limit = 0}) end)
step('select offset past end', function() return users:select({}, {offset = 100}) end)
step('select empty key lt', function() return users:select({}, {iterator = 'LT'}) end)
step('select empty key le limit', function() return users:select({}, {iterator = 'LE', limit = 2}) end)
step('min', function() return users.index.primary:min() end)
step('max', function() return users.index.primary:max() end)
step('select key too long', function() return users:select({1, 2}) end)
step('select key wrong type', function() return users:select({'a'}) end)
-- net.box resolves index names itself: an unknown index id goes over the wire only this way
step('select no such index', function() return conn:_request('select', nil, nil, users.id, 7, 0, 0, 10, {1}) end)

-- update, by field number and by field name
step('update add by number', function() return users:update(1, {{'+', 3, 1}}) end)
step('update set by name', function() return users:update(2, {{'=', 'name', 'robert'}}) end)
step('update subtract negative field', function() return users:update(3, {{'-', -1, 5}}) end)
step('update several ops', function() return users:update(4, {{'+', 'age', 10}, {':', 2, 1, 1, 'D'}}) end)
step('update append field', function() return users:update(5, {{'!', 4, 'x'}}) end)
step('update insert field', function() return users:update(5, {{'!', 4, 'y'}}) end)
step('update delete field', function() return users:update(5, {{'#', 4, 2}}) end)
step('update bit and', function() return users:update(7, {{'&', 3, 56}}) end)
step('update bit or', function() return users:update(7, {{'|', 3, 2}}) end)
step('update bit xor', function() return users:update(7, {{'^', 'age', 1}}) end)
step('update same field twice', function() return users:update(7, {{'+', 3, 1}, {'-', 3, 1}}) end)
step('update bit op on string', function() return users:update(7, {{'&', 2, 1}}) end)
step('update missing key', function() return users:update(99, {{'+', 3, 1}}) end)
step('update wrong arg type', function() return users:update(1, {{'+', 2, 1}}) end)
step('update primary key', function() return users:update(1, {{'=', 1, 100}}) end)
step('update delete required field', function() return users:update(1, {{'#', 3, 1}}) end)
step('update no such field name', function() return users:update(1, {{'=', 'nope', 1}}) end)
step('update field out of range', function() return users:update(1, {{'=', 9, 1}}) end)
step('update unknown op', function() return users:update(1, {{'?', 3, 1}}) end)
step('update breaks format', function() return users:update(1, {{'=', 3, 'old'}}) end)

-- upsert: the first inserts, the second applies its operations; a failing op is skipped
step('upsert insert', function() return users:upsert({6, 'fay', 50}, {{'+', 3, 1}}) end)
step('upsert update', function() return users:upsert({6, 'ignored', 0}, {{'+', 3, 1}}) end)
step('upsert bad op skipped', function() return users:upsert({6, 'ignored', 0}, {{'+', 2, 1}}) end)
step('upsert by name', function() return users:upsert({6, 'ignored', 0}, {{'=', 'name', 'fay2'}}) end)
step('get after upserts', function() return users:get(6) end)
step('upsert wrong type', function() return users:upsert({'z', 'z', 1}, {{'+', 3, 1}}) end)

-- delete
step('delete', function() return users:delete(3) end)
step('delete missing', function() return users:delete(3) end)
step('delete wrong type', function() return users:delete('three') end)
step('select all after writes', function() return users:select({}) end)

-- a two-part primary key: full and partial keys
for _, t in ipairs({{1, 1, 'login'}, {1, 2, 'view', 'home'}, {1, 3, 'logout'}, {2, 1, 'login'}, {3, 1, 'view'}}) do
    step('events insert ' .. t[1] .. '/' .. t[2], function() return events:insert(t) end)
end
step('events duplicate', function() return events:insert({1, 2, 'again'}) end)
step('events select all', function() return events:select({}) end)
step('events partial eq', function() return events:select({1}) end)
step('events partial req', function() return events:select({1}, {iterator = 'REQ'}) end)
step('events partial gt', function() return events:select({1}, {iterator = 'GT'}) end)
step('events partial le', function() return events:select({2}, {iterator = 'LE'}) end)
step('events full ge', function() return events:select({1, 2}, {iterator = 'GE'}) end)
step('events full lt limit', function() return events:select({3, 1}, {iterator = 'LT', limit = 3}) end)
step('events get full', function() return events:get({1, 2}) end)
step('events get partial', function() return events:get({1}) end)
step('events update', function() return events:update({1, 2}, {{'=', 'note', 'start'}}) end)
step('events update partial key', function() return events:update({1}, {{'=', 'note', 'x'}}) end)
step('events delete', function() return events:delete({2, 1}) end)
step('events select after', function() return events:select({}) end)

-- value types at the edges
step('insert negative unsigned', function() return users:insert({9, 'ivy', -1}) end)
step('insert float unsigned', function() return users:insert({9, 'ivy', 1.5}) end)
step('insert max unsigned', function() return users:insert({18446744073709551615ULL, 'max', 0}) end)
step('get max unsigned', function() return users:get(18446744073709551615ULL) end)
step('update float add', function() return users:update(1, {{'+', 3, 0.5}}) end)
step('update overflow', function() return users:update(18446744073709551615ULL, {{'+', 3, -1}}) end)
step('events set nullable to nil', function() return events:update({1, 2}, {{'=', 4, box.NULL}}) end)
step('events insert nil required', function() return events:insert({4, 1, box.NULL}) end)
step('events partial delete', function() return events:delete({1}) end)

-- calls and evals of sluice's built-in set (user app may execute: Tarantool's grant on universe)
step('index count', function() return users.index.primary:count() end)
step('index count ge', function() return users.index.primary:count({5}, {iterator = 'GE'}) end)
step('events partial count', function() return events.index.primary:count({1}) end)
step('call session user', function() return conn:call('box.session.user') end)
step('call no such function', function() return conn:call('no_such_function', {1}) end)
step('call count', function() return conn:call('box.space.users:count') end)
step('eval arguments', function() return {conn:eval('return ...', {1, 'two', {3}})} end)
step('eval len', function() return conn:eval('return box.space.users:len()') end)
conn:close()

-- guest (no grants) and a wrong password
local guest = net_box.connect(address, {wait_connected = true})
step('guest ping', function() return guest:ping() end)
step('guest sees users', function() return guest.space.users ~= nil end)
step('guest select', function() return guest:_request('select', nil, nil, 512, 0, 0, 0, 10, {}) end)
step('guest insert', function() return guest:_request('insert', nil, nil, 512, {20, 'x', 1}) end)
guest:close()
local bad = net_box.connect(address, {user = user, password = 'wrong', wait_connected = true})
step('wrong password', function() return bad.error end)
bad:close()
local nobody = net_box.connect(address, {user = 'nobody', password = 'x', wait_connected = true})
step('no such user', function() return nobody.error end)
nobody:close()
