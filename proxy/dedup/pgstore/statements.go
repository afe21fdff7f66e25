package pgstore

import (
	"strconv"
	"time"
)

// statements are the SQL this package runs, with the schema filled in.
// Times that decide expiry are the database's (now()), so the instances'
// clocks need not agree; durations travel as milliseconds.
type statements struct {
	version string

	// The cache.
	get, set, resync, del, delURL, dropValue, dropBigValue string

	// Flights.
	acquire, dropOutcome, dropBigOutcome, finishValue, setOutcome, unlock, release string
	markWaiting, pollWaits                                                         string
	// Streaming a body from the leader's peer listener.
	stream, peer, expirePeer string

	// The bus.
	notify, keepNote, recall, claim, unclaim, take string
	bind, rebind                                   string

	// Statistics.
	flushStats, readStats string
	sweep, sweepAbsurd    string
}

// upsertValue writes a cached value; cache rows are replaced whole.
const upsertValue = `INSERT INTO {s}.cache AS c (key, url_key, value, size, stored_at, expires_at)
	VALUES ($1, $2, $3::bytea, octet_length($3::bytea), $4, now() + $5::bigint * interval '1 millisecond')
	ON CONFLICT (key) DO UPDATE SET url_key = excluded.url_key, value = excluded.value, size = excluded.size,
		stored_at = excluded.stored_at, expires_at = excluded.expires_at`

// lastingLimit is the latest expiry of a note or a claim this package
// writes (maxLasting from now), in SQL: anything later was written by
// someone else ('infinity' by hand), and counts as expired.
var lastingLimit = "(now() + " + strconv.FormatInt(maxLasting.Milliseconds(), 10) + "::bigint * interval '1 millisecond')"

// purgeMark is the tombstone of a purge of key (an SQL expression): the
// purge's time in Unix ms, kept purgeKeep in the notes table (topic
// 'purged', which no instance subscribes to).
func purgeMark(key string) string {
	return `INSERT INTO {s}.notes AS o (topic, key, msg, expires_at)
		VALUES ('purged', ` + key + `, (extract(epoch FROM now()) * 1000)::bigint::text,
			now() + ` + strconv.FormatInt(purgeKeep.Milliseconds(), 10) + `::bigint * interval '1 millisecond')
		ON CONFLICT (topic, key) DO UPDATE SET msg = excluded.msg, expires_at = excluded.expires_at`
}

// purgeKeep is how long a purge's tombstone lasts: as long as a copy
// cached during an outage may wait to be shared (a day of TTL).
const purgeKeep = 24 * time.Hour

// satAdd is the stats table's column plus the excluded row's, clamped to
// bigint.
func satAdd(col string) string {
	return "greatest(least(t." + col + "::numeric + excluded." + col + ", 9223372036854775807), -9223372036854775808)::bigint"
}

// maxPeerRow bounds a peer row read back: "p1 <instance> <address>" is
// far shorter, and a bigger row is not read (as none: fetch our own).
const maxPeerRow = 1024

func newStatements(schema string) statements {
	s := func(sql string) string { return schemaSQL(schema, sql) }
	return statements{
		version: s(`SELECT value FROM {s}.meta WHERE name = 'schema_version'`),

		// The value only when it holds at most $2 bytes (max_value_bytes),
		// and its size: a bigger one, which this build never writes, would
		// cost every read its transfer and likely the statement timeout.
		get: s(`SELECT CASE WHEN octet_length(value) <= $2 THEN value END, octet_length(value)
			FROM {s}.cache WHERE key = $1 AND expires_at > now()`),
		// A value and the wake-up of every instance's waiters, committed
		// together ($6 channel, $7 payload).
		set: s(`WITH w AS (` + upsertValue + `) SELECT pg_notify($6, $7)`),
		// A value this instance cached while the database was away: it
		// replaces only an older one, and then tells every instance to
		// drop older copies from its memory tier ($6 channel, $7
		// payload). A row when it did.
		// Not when the key or its URL was purged after it was fetched.
		resync: s(`WITH w AS (INSERT INTO {s}.cache AS c (key, url_key, value, size, stored_at, expires_at)
				SELECT $1, $2, $3::bytea, octet_length($3::bytea), $4, now() + $5::bigint * interval '1 millisecond'
				WHERE NOT EXISTS (SELECT 1 FROM {s}.notes p WHERE p.topic = 'purged' AND p.key IN ('k ' || $1, 'u ' || $2)
					AND p.expires_at > now() AND p.msg ~ '^[0-9]{1,15}$' AND p.msg::bigint >= (extract(epoch FROM $4::timestamptz) * 1000)::bigint)
				ON CONFLICT (key) DO UPDATE SET url_key = excluded.url_key, value = excluded.value, size = excluded.size,
					stored_at = excluded.stored_at, expires_at = excluded.expires_at
				WHERE c.stored_at < excluded.stored_at RETURNING 1)
			SELECT true FROM w CROSS JOIN LATERAL pg_notify($6, $7) n`),
		// Each also leaves a tombstone (purgeMark): a value fetched before
		// the purge by an instance cut off from the database must not
		// come back with its resync.
		del: s(`WITH d AS (DELETE FROM {s}.cache WHERE key = $1), t AS (` + purgeMark("'k ' || $1") + `)
			SELECT pg_notify($2, $3)`),
		delURL: s(`WITH d AS (DELETE FROM {s}.cache WHERE url_key = $1 RETURNING 1),
			t AS (` + purgeMark("'u ' || $1") + `),
			n AS (SELECT pg_notify($2, $3))
			SELECT (SELECT count(*) FROM d) FROM n`),
		// Removes a value this build cannot read, unless it was replaced
		// meanwhile.
		dropValue: s(`DELETE FROM {s}.cache WHERE key = $1 AND md5(value) = $2`),
		// Removes a value bigger than $2 bytes, unless it was replaced
		// meanwhile by one that is not (octet_length does not read a
		// stored value, where md5 would read all of it).
		dropBigValue: s(`DELETE FROM {s}.cache WHERE key = $1 AND octet_length(value) > $2`),

		// A flight's value, and the wake-up of every instance's waiters
		// only when one of them marked the flight as waited on (the
		// mark, $8, goes with it): a miss nobody waits for costs the
		// fleet's listeners nothing.
		finishValue: s(`WITH w AS (` + upsertValue + `),
			m AS (DELETE FROM {s}.outcomes WHERE key = $8 RETURNING 1)
			SELECT pg_notify($6, $7) FROM (SELECT 1 FROM m LIMIT 1) waited`),
		// A waiter's mark on the flight it waits for ($1, the wait row's
		// key, for $2 ms), and whether the flight ($3) stored its value
		// meanwhile: then it looks again instead of waiting for a wake-up
		// that was sent before its mark.
		markWaiting: s(`WITH m AS (INSERT INTO {s}.outcomes AS o (key, value, expires_at)
			VALUES ($1, ''::bytea, now() + $2::bigint * interval '1 millisecond')
			ON CONFLICT (key) DO UPDATE SET expires_at = greatest(o.expires_at, excluded.expires_at))
			SELECT EXISTS (SELECT 1 FROM {s}.cache WHERE key = $3 AND expires_at > now())`),
		// Of the keys waited on ($1, their locks $2), those whose flight
		// ended (a value, or an outcome) or has no leader any more (the
		// lock is free: a transaction lock, gone at the statement's end,
		// as acquire's look takes it).
		pollWaits: s(`SELECT k.key FROM unnest($1::text[], $2::bigint[]) AS k(key, lock)
			WHERE EXISTS (SELECT 1 FROM {s}.cache c WHERE c.key = k.key AND c.expires_at > now())
				OR EXISTS (SELECT 1 FROM {s}.outcomes o WHERE o.key = k.key AND o.expires_at > now())
				OR pg_try_advisory_xact_lock(k.lock)`),
		// The size of a value or an outcome found comes back with it, and
		// the bytes only up to $5 (max_value_bytes).
		acquire:        s(`SELECT state, val, coalesce(val_size, 0) FROM {s}.acquire_bounded($1, $2, $3, $4, $5)`),
		dropOutcome:    s(`DELETE FROM {s}.outcomes WHERE key = $1 AND md5(value) = $2`),
		dropBigOutcome: s(`DELETE FROM {s}.outcomes WHERE key = $1 AND octet_length(value) > $2`),
		// A flight's outcome without a value, and the wake-up only when
		// someone marked the flight as waited on ($6), as finishValue;
		// all of it only while no other session holds the flight's lock
		// ($7). A leader whose lock went with its session's connection (or
		// a session reset) ends this way while another instance may lead
		// the key's next flight: its failure is not that flight's answer,
		// and the mark and the wake-up are that flight's waiters'. The
		// transaction lock takes nothing from the lock's holder (a
		// session's locks are re-entrant: on the leader's own session it
		// succeeds) and goes at the end of the transaction.
		setOutcome: s(`WITH g AS (SELECT pg_try_advisory_xact_lock($7) AS free),
			w AS (INSERT INTO {s}.outcomes (key, value, expires_at)
				SELECT $1::text, $2::bytea, now() + $3::bigint * interval '1 millisecond' FROM g WHERE g.free
				ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at),
			m AS (DELETE FROM {s}.outcomes WHERE key = $6 AND (SELECT free FROM g) RETURNING 1)
			SELECT pg_notify($4, $5) FROM (SELECT 1 FROM m LIMIT 1) waited`),
		unlock: `SELECT pg_advisory_unlock($1)`,
		// The TooLarge outcome ($1, $2) and the row naming the leader's
		// peer listener ($3, $4), both for $5 ms, and the wake-up ($6
		// channel, $7 payload), on the leader's session, and only while
		// no other session holds the flight's lock ($8, as setOutcome):
		// a row when it wrote them.
		stream: s(`WITH g AS (SELECT pg_try_advisory_xact_lock($8) AS free),
			w AS (INSERT INTO {s}.outcomes (key, value, expires_at)
				SELECT v.key, v.value, now() + $5::bigint * interval '1 millisecond'
				FROM (VALUES ($1::text, $2::bytea), ($3::text, $4::bytea)) v (key, value), g WHERE g.free
				ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
				RETURNING 1)
			SELECT pg_notify($6, $7) FROM (SELECT 1 FROM w LIMIT 1) streamed`),
		peer: s(`SELECT value FROM {s}.outcomes WHERE key = $1 AND expires_at > now()
			AND octet_length(value) <= ` + strconv.Itoa(maxPeerRow)),
		// Cuts a streamed flight's peer row at its end, unless another
		// session holds the lock ($3, as setOutcome): the row is then the
		// next flight's.
		expirePeer: s(`UPDATE {s}.outcomes SET expires_at = now() + $2::bigint * interval '1 millisecond'
			WHERE key = $1 AND pg_try_advisory_xact_lock($3)`),
		// Gives up a flight without an outcome: its waiters take over at
		// once instead of at their next poll.
		release: `SELECT pg_advisory_unlock($1), pg_notify($2, $3)`,

		notify: `SELECT pg_notify($1, $2)`,
		// A lasting note replaces the one kept for its key unless that one
		// lasts longer, which one lasting past lastingLimit does not: no
		// instance wrote it.
		keepNote: s(`WITH k AS (INSERT INTO {s}.notes AS o (topic, key, msg, expires_at)
			VALUES ($1, $2, $3, now() + $4::bigint * interval '1 millisecond')
			ON CONFLICT (topic, key) DO UPDATE SET msg = excluded.msg, expires_at = excluded.expires_at
			WHERE o.expires_at < excluded.expires_at OR o.expires_at > ` + lastingLimit + `)
			SELECT pg_notify($5, $6) WHERE $6::text <> ''`),
		// What is left of each note, in ms; 0 (refused by recalledNote)
		// for a note lasting past lastingLimit, whose time left may not
		// even be a number ('infinity' - now() is an error).
		recall: s(`SELECT msg, CASE WHEN expires_at <= ` + lastingLimit + `
				THEN (extract(epoch FROM expires_at - now()) * 1000)::bigint ELSE 0 END
			FROM {s}.notes WHERE topic = $1 AND expires_at > now()`),
		// A claim gives way when expired, or when it lasts past
		// lastingLimit: no instance wrote it, and it would hold the name
		// for good.
		claim: s(`INSERT INTO {s}.claims AS c (name, token, expires_at)
			VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond')
			ON CONFLICT (name) DO UPDATE SET token = excluded.token, expires_at = excluded.expires_at
			WHERE c.expires_at <= now() OR c.expires_at > ` + lastingLimit + `
			RETURNING true`),
		unclaim: s(`DELETE FROM {s}.claims WHERE name = $1 AND token = $2`),
		// A sticky key's session: the row lock of the upsert makes racing
		// instances agree on whoever came first; either way the binding
		// holds $3 ms from now. An expired binding counts as none.
		bind: s(`INSERT INTO {s}.bindings AS b (key, session, expires_at)
			VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond')
			ON CONFLICT (key) DO UPDATE SET
				session = CASE WHEN b.expires_at <= now() THEN excluded.session ELSE b.session END,
				expires_at = excluded.expires_at
			RETURNING session`),
		// Moves a sticky key from $2 to $3 unless it moved already.
		rebind: s(`INSERT INTO {s}.bindings AS b (key, session, expires_at)
			VALUES ($1, $3, now() + $4::bigint * interval '1 millisecond')
			ON CONFLICT (key) DO UPDATE SET
				session = CASE WHEN b.expires_at <= now() OR b.session = $2 THEN excluded.session ELSE b.session END,
				expires_at = excluded.expires_at
			RETURNING session`),
		// The rate limiter's step (ratelimit.Counter): the row holds the
		// client's time in microseconds by the database's clock, which
		// every instance shares; $2 is the interval and $3 the burst (µs).
		// The upsert's row lock orders racing instances; a refusal writes
		// nothing, and reports how far ahead the row was (read before
		// it), at least burst - interval: the upsert decides on the row
		// as it finds it once the lock is its, which racing takes may
		// have moved past this statement's snapshot, and a refusal
		// reported less ahead than that told the client it had room left
		// (Decision.Remaining) and could retry at once. A row this
		// package did not write (an expired one, or one
		// far ahead) counts as a client at rest or, ahead, as one whose
		// burst is spent: it neither fails the statement, which the
		// breaker would take for the database failing, nor holds a
		// client back for longer than a burst.
		take: s(`WITH clock AS (SELECT (extract(epoch FROM now()) * 1000000)::bigint AS us),
			before AS (SELECT n, expires_at FROM {s}.counters WHERE key = $1),
			took AS (
				INSERT INTO {s}.counters AS c (key, n, expires_at)
				SELECT $1, us + $2, now() + ($2 + 1000000) * interval '1 microsecond' FROM clock
				ON CONFLICT (key) DO UPDATE SET
					n = ` + takeBase + ` + $2,
					expires_at = now() + (` + takeBase + ` + $2 - (excluded.n - $2) + 1000000) * interval '1 microsecond'
				WHERE ` + takeBase + ` + $2 - (excluded.n - $2) <= $3
				RETURNING n)
			SELECT (SELECT n - us FROM took),
				(SELECT greatest(CASE WHEN expires_at <= now() THEN 0 ELSE least(greatest(n, us), us + $3) - us END, $3 - $2 + 1) FROM before)
			FROM clock`),

		// A batch of counts (dedup.DayBatch) is added once: stats_added
		// keeps the last batch each instance ($8) added, and a batch sent
		// again because its answer never came ($9 the same) adds nothing.
		// One statement, so the mark and the sums commit together; it
		// also drops the marks of instances gone for a week (a handful of
		// rows: a process's id is new at each start). Sums saturate: a
		// row no build writes (a count at the bigint maximum) must not
		// fail every flush, which the breaker would take for the
		// database failing.
		flushStats: s(`WITH gone AS (DELETE FROM {s}.stats_added WHERE at < now() - interval '8 days'),
			mark AS (INSERT INTO {s}.stats_added AS a (instance, batch, at) VALUES ($8, $9, now())
				ON CONFLICT (instance) DO UPDATE SET batch = excluded.batch, at = excluded.at
				WHERE a.batch <> excluded.batch
				RETURNING 1)
			INSERT INTO {s}.stats AS t (day, hit, coalesced, miss, bypass, bytes_avoided, money_nano)
			SELECT $1, $2, $3, $4, $5, $6, $7 WHERE EXISTS (SELECT 1 FROM mark)
			ON CONFLICT (day) DO UPDATE SET hit = ` + satAdd("hit") + `, coalesced = ` + satAdd("coalesced") + `,
				miss = ` + satAdd("miss") + `, bypass = ` + satAdd("bypass") + `,
				bytes_avoided = ` + satAdd("bytes_avoided") + `, money_nano = ` + satAdd("money_nano")),
		readStats: s(`SELECT day, hit, coalesced, miss, bypass, bytes_avoided, money_nano FROM {s}.stats WHERE day >= $1 AND day <= $2`),
		sweep:     s(`SELECT swept, expired, evicted FROM {s}.sweep($1, $2, $3)`),
		// What the sweep function leaves for good, up to $1 rows of each
		// table: notes and claims lasting past lastingLimit, and rows of
		// any table that never expire ('infinity'), none of which this
		// package writes. Run in the sweep's transaction, under its lock.
		sweepAbsurd: s(`WITH n AS (DELETE FROM {s}.notes WHERE (topic, key) IN
				(SELECT topic, key FROM {s}.notes WHERE expires_at > ` + lastingLimit + ` LIMIT $1)
				AND expires_at > ` + lastingLimit + ` RETURNING 1),
			c AS (DELETE FROM {s}.claims WHERE name IN
				(SELECT name FROM {s}.claims WHERE expires_at > ` + lastingLimit + ` LIMIT $1)
				AND expires_at > ` + lastingLimit + ` RETURNING 1),
			k AS (DELETE FROM {s}.cache WHERE key IN
				(SELECT key FROM {s}.cache WHERE expires_at = 'infinity' LIMIT $1)
				AND expires_at = 'infinity' RETURNING 1),
			o AS (DELETE FROM {s}.outcomes WHERE key IN
				(SELECT key FROM {s}.outcomes WHERE expires_at = 'infinity' LIMIT $1)
				AND expires_at = 'infinity' RETURNING 1),
			x AS (DELETE FROM {s}.counters WHERE key IN
				(SELECT key FROM {s}.counters WHERE expires_at = 'infinity' LIMIT $1)
				AND expires_at = 'infinity' RETURNING 1),
			b AS (DELETE FROM {s}.bindings WHERE key IN
				(SELECT key FROM {s}.bindings WHERE expires_at = 'infinity' LIMIT $1)
				AND expires_at = 'infinity' RETURNING 1)
			SELECT (SELECT count(*) FROM n) + (SELECT count(*) FROM c) + (SELECT count(*) FROM k)
				+ (SELECT count(*) FROM o) + (SELECT count(*) FROM x) + (SELECT count(*) FROM b)`),
	}
}

// takeBase is where the rate limiter's step starts from, in microseconds
// (see take): the row's time, or now when the row lags behind now or has
// expired, and at most a burst ahead of now. excluded.n is now plus the
// interval.
const takeBase = `CASE WHEN c.expires_at <= now() THEN excluded.n - $2
	ELSE least(greatest(c.n, excluded.n - $2), excluded.n - $2 + $3) END`
