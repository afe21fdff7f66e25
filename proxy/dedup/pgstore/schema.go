package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// schemaVersion is the layout of onceproxy's tables and functions that this
// build reads and writes. Another version in the configured schema is
// refused, never misread: a fleet mid-upgrade runs each version in a schema
// of its own (postgres.schema).
//
// Within a version, a build may add a function (every start creates what
// is missing) but never change or drop one: builds of the same version
// share the schema, and each keeps calling the functions it knows. An
// older build starting later recreates its own functions as they were and
// leaves the newer ones alone.
const schemaVersion = 1

// errSchema marks a schema this build must not use: another version, or a
// schema onceproxy did not make.
var errSchema = errors.New("pgstore: schema refused")

// ddl creates schema version 1; every statement is idempotent. {s} is the
// quoted schema name.
//
// Unlogged tables skip the write-ahead log: a cache, its flight outcomes,
// notes, claims, sticky bindings and counters are cheap to lose (PostgreSQL empties them
// after a crash) and cost a fraction of a logged write. The per-day
// statistics are logged: they are what the fleet reports for a week.
const ddl = `
CREATE UNLOGGED TABLE IF NOT EXISTS {s}.cache (
	key        text PRIMARY KEY,
	url_key    text NOT NULL,
	value      bytea NOT NULL,
	size       integer NOT NULL,
	stored_at  timestamptz NOT NULL,
	expires_at timestamptz NOT NULL
);
-- CREATE INDEX IF NOT EXISTS takes its SHARE lock on the table before it
-- looks for the index: behind any open writer it would queue, and every
-- instance's writes to the cache behind it, each time an instance starts.
DO $do$ BEGIN
	IF to_regclass('{s}.cache_url_key') IS NULL THEN
		CREATE INDEX cache_url_key ON {s}.cache (url_key) WHERE url_key <> '';
	END IF;
	IF to_regclass('{s}.cache_expires_at') IS NULL THEN
		CREATE INDEX cache_expires_at ON {s}.cache (expires_at);
	END IF;
	IF to_regclass('{s}.cache_stored_at') IS NULL THEN
		CREATE INDEX cache_stored_at ON {s}.cache (stored_at);
	END IF;
END $do$;

-- A value reaches the table compressed (S2) when compressing it pays.
-- PostgreSQL would try its own compression (pglz) on every row over 2 KB
-- all the same, and move the value out of line (TOAST: two more inserts
-- per write, and as many reads): rows keep values up to 8 KB in line, and
-- bigger ones go out of line as they come. Measured with onceload's
-- Stores/postgres/miss (2 KiB bodies of hex): 3,110-3,135 unique misses/s
-- before, 3,940-3,980 after. Checked first: ALTER TABLE locks the table
-- against every instance's statements, which a start must not do to a
-- running fleet each time; it does once, on the first start of a build
-- with these settings, and gives up after half a second behind a
-- statement that holds the table (the next start tries again), rather
-- than hold up every instance's statements queued behind it meanwhile.
DO $do$ BEGIN
	PERFORM set_config('lock_timeout', '500ms', true);
	IF NOT EXISTS (SELECT 1 FROM pg_attribute
			WHERE attrelid = '{s}.cache'::regclass AND attname = 'value' AND attstorage = 'e') THEN
		ALTER TABLE {s}.cache ALTER COLUMN value SET STORAGE EXTERNAL;
	END IF;
	IF NOT EXISTS (SELECT 1 FROM pg_class
			WHERE oid = '{s}.cache'::regclass AND 'toast_tuple_target=8160' = ANY (reloptions)) THEN
		ALTER TABLE {s}.cache SET (toast_tuple_target = 8160);
	END IF;
	PERFORM set_config('lock_timeout', '0', true);
EXCEPTION WHEN lock_not_available THEN
	PERFORM set_config('lock_timeout', '0', true);
	RAISE WARNING 'onceproxy: the cache table is busy; its storage settings wait for the next start';
END $do$;

CREATE UNLOGGED TABLE IF NOT EXISTS {s}.outcomes (
	key        text PRIMARY KEY,
	value      bytea NOT NULL,
	expires_at timestamptz NOT NULL
);

CREATE UNLOGGED TABLE IF NOT EXISTS {s}.notes (
	topic      text NOT NULL,
	key        text NOT NULL,
	msg        text NOT NULL,
	expires_at timestamptz NOT NULL,
	PRIMARY KEY (topic, key)
);

CREATE UNLOGGED TABLE IF NOT EXISTS {s}.claims (
	name       text PRIMARY KEY,
	token      text NOT NULL,
	expires_at timestamptz NOT NULL
);

CREATE UNLOGGED TABLE IF NOT EXISTS {s}.bindings (
	key        text PRIMARY KEY,
	session    text NOT NULL,
	expires_at timestamptz NOT NULL
);

CREATE UNLOGGED TABLE IF NOT EXISTS {s}.counters (
	key        text PRIMARY KEY,
	n          bigint NOT NULL,
	expires_at timestamptz NOT NULL
);

CREATE TABLE IF NOT EXISTS {s}.stats (
	day           date PRIMARY KEY,
	hit           bigint NOT NULL DEFAULT 0,
	coalesced     bigint NOT NULL DEFAULT 0,
	miss          bigint NOT NULL DEFAULT 0,
	bypass        bigint NOT NULL DEFAULT 0,
	bytes_avoided bigint NOT NULL DEFAULT 0,
	money_nano    bigint NOT NULL DEFAULT 0
);

-- The last batch of counts each instance added to stats (see flushStats).
CREATE TABLE IF NOT EXISTS {s}.stats_added (
	instance text PRIMARY KEY,
	batch    text NOT NULL,
	at       timestamptz NOT NULL
);

-- acquire is one step of a fleet flight, in one round trip:
--   2 + value    the key is cached (found at once: a hit; after waiting:
--                the flight waited on stored it)
--   3 + outcome  after waiting: the flight waited on ended without a value
--   0            another session holds the key's lock: wait
--   1            this session took the lock: fetch (p_take)
--   4            nobody holds the lock, none taken (not p_take)
-- VOLATILE: each query inside sees what committed before it, so the
-- re-check after taking the lock sees a flight that committed and unlocked
-- between the first check and the lock. A lock is taken only with p_take,
-- on a connection held for the flight; the look-only variant takes a
-- transaction lock, which cannot outlive this statement on a pooled
-- connection.
CREATE OR REPLACE FUNCTION {s}.acquire(p_lock bigint, p_key text, p_waited boolean, p_take boolean,
	OUT state integer, OUT val bytea)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
	SELECT c.value INTO val FROM {s}.cache c WHERE c.key = p_key AND c.expires_at > now();
	IF FOUND THEN state := 2; RETURN; END IF;
	IF p_waited THEN
		SELECT o.value INTO val FROM {s}.outcomes o WHERE o.key = p_key AND o.expires_at > now();
		IF FOUND THEN state := 3; RETURN; END IF;
	END IF;
	IF NOT p_take THEN
		state := CASE WHEN pg_try_advisory_xact_lock(p_lock) THEN 4 ELSE 0 END;
		RETURN;
	END IF;
	IF NOT pg_try_advisory_lock(p_lock) THEN state := 0; RETURN; END IF;
	SELECT c.value INTO val FROM {s}.cache c WHERE c.key = p_key AND c.expires_at > now();
	IF FOUND THEN PERFORM pg_advisory_unlock(p_lock); state := 2; RETURN; END IF;
	IF p_waited THEN
		SELECT o.value INTO val FROM {s}.outcomes o WHERE o.key = p_key AND o.expires_at > now();
		IF FOUND THEN PERFORM pg_advisory_unlock(p_lock); state := 3; RETURN; END IF;
	END IF;
	-- A new flight: the outcome of an older one is not its answer.
	DELETE FROM {s}.outcomes WHERE key = p_key;
	state := 1;
	val := NULL;
END
$fn$;

-- acquire_bounded is acquire, but reads a value or an outcome only when it
-- holds at most p_max bytes (max_value_bytes): a bigger one comes back as
-- its size alone (val NULL, val_size > p_max; octet_length reads no stored
-- bytes), for the caller to drop. A row no instance of this build writes
-- (put there by hand, or by an instance with a larger max_value_bytes)
-- would otherwise cost every step its whole transfer, past the statement
-- timeout. Added beside acquire, which older builds of version 1 call.
CREATE OR REPLACE FUNCTION {s}.acquire_bounded(p_lock bigint, p_key text, p_waited boolean, p_take boolean, p_max bigint,
	OUT state integer, OUT val bytea, OUT val_size integer)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
	SELECT CASE WHEN octet_length(c.value) <= p_max THEN c.value END, octet_length(c.value) INTO val, val_size
		FROM {s}.cache c WHERE c.key = p_key AND c.expires_at > now();
	IF FOUND THEN state := 2; RETURN; END IF;
	IF p_waited THEN
		SELECT CASE WHEN octet_length(o.value) <= p_max THEN o.value END, octet_length(o.value) INTO val, val_size
			FROM {s}.outcomes o WHERE o.key = p_key AND o.expires_at > now();
		IF FOUND THEN state := 3; RETURN; END IF;
	END IF;
	IF NOT p_take THEN
		state := CASE WHEN pg_try_advisory_xact_lock(p_lock) THEN 4 ELSE 0 END;
		RETURN;
	END IF;
	IF NOT pg_try_advisory_lock(p_lock) THEN state := 0; RETURN; END IF;
	SELECT CASE WHEN octet_length(c.value) <= p_max THEN c.value END, octet_length(c.value) INTO val, val_size
		FROM {s}.cache c WHERE c.key = p_key AND c.expires_at > now();
	IF FOUND THEN PERFORM pg_advisory_unlock(p_lock); state := 2; RETURN; END IF;
	IF p_waited THEN
		SELECT CASE WHEN octet_length(o.value) <= p_max THEN o.value END, octet_length(o.value) INTO val, val_size
			FROM {s}.outcomes o WHERE o.key = p_key AND o.expires_at > now();
		IF FOUND THEN PERFORM pg_advisory_unlock(p_lock); state := 3; RETURN; END IF;
	END IF;
	-- A new flight: the outcome of an older one is not its answer.
	DELETE FROM {s}.outcomes WHERE key = p_key;
	state := 1;
	val := NULL;
	val_size := NULL;
END
$fn$;

-- sweep deletes up to p_batch expired rows of each table (each DELETE
-- checks the expiry again on the row it locks: a row another session
-- renewed and committed while the DELETE waited for it is live, and the
-- subquery's match, from the statement's snapshot, does not say so), then, while the
-- cache holds more than p_max_bytes, up to p_batch of its oldest rows. One
-- instance of the fleet at a time (a transaction lock: swept is false when
-- another instance is at it).
CREATE OR REPLACE FUNCTION {s}.sweep(p_lock bigint, p_batch integer, p_max_bytes bigint,
	OUT swept boolean, OUT expired integer, OUT evicted integer)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
	n integer;
	excess bigint;
BEGIN
	expired := 0;
	evicted := 0;
	swept := pg_try_advisory_xact_lock(p_lock);
	IF NOT swept THEN RETURN; END IF;
	DELETE FROM {s}.cache WHERE key IN
		(SELECT key FROM {s}.cache WHERE expires_at <= now() ORDER BY expires_at LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS expired = ROW_COUNT;
	DELETE FROM {s}.outcomes WHERE key IN
		(SELECT key FROM {s}.outcomes WHERE expires_at <= now() LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS n = ROW_COUNT;
	expired := expired + n;
	DELETE FROM {s}.notes WHERE (topic, key) IN
		(SELECT topic, key FROM {s}.notes WHERE expires_at <= now() LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS n = ROW_COUNT;
	expired := expired + n;
	DELETE FROM {s}.claims WHERE name IN
		(SELECT name FROM {s}.claims WHERE expires_at <= now() LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS n = ROW_COUNT;
	expired := expired + n;
	DELETE FROM {s}.counters WHERE key IN
		(SELECT key FROM {s}.counters WHERE expires_at <= now() LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS n = ROW_COUNT;
	expired := expired + n;
	DELETE FROM {s}.bindings WHERE key IN
		(SELECT key FROM {s}.bindings WHERE expires_at <= now() LIMIT p_batch)
		AND expires_at <= now();
	GET DIAGNOSTICS n = ROW_COUNT;
	expired := expired + n;
	DELETE FROM {s}.stats WHERE day < (now() AT TIME ZONE 'UTC')::date - 8;
	SELECT coalesce(sum(size), 0) - p_max_bytes INTO excess FROM {s}.cache;
	IF excess > 0 THEN
		-- By key and stored_at: a row stored again while the DELETE
		-- waited for it is the newest now, not one of the oldest.
		DELETE FROM {s}.cache WHERE (key, stored_at) IN (
			SELECT o.key, o.stored_at FROM (
				SELECT key, size, stored_at, sum(size) OVER (ORDER BY stored_at, key) AS acc
				FROM (SELECT key, size, stored_at FROM {s}.cache ORDER BY stored_at, key LIMIT p_batch) oldest
			) o
			WHERE o.acc - o.size < excess);
		GET DIAGNOSTICS evicted = ROW_COUNT;
	END IF;
END
$fn$;
`

// schemaSQL fills the schema name into sql.
func schemaSQL(schema, sql string) string {
	return strings.ReplaceAll(sql, "{s}", pgx.Identifier{schema}.Sanitize())
}

// setupTimeout bounds creating or checking the schema: more than a
// statement, since the first start creates every table.
const setupTimeout = 10 * time.Second

// setup checks the configured schema and creates what is missing, once per
// database at a time (a transaction lock). It returns an error wrapping
// errSchema for a schema this build must not use.
func (c *client) setup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, setupTimeout)
	defer cancel()
	err := c.createSchema(ctx)
	var pe *pgconn.PgError
	if errors.As(err, &pe) && strings.HasPrefix(pe.Code, "42") {
		// Access rule violations (no privilege on the database or the
		// schema, a name PostgreSQL reserves): the same on every try,
		// so the operator hears of it now instead of the instance
		// running alone for good, the database taken for unreachable.
		return fmt.Errorf("%w: postgres.schema %q cannot be set up by this role: %w", errSchema, c.cfg.Schema, err)
	}
	return err
}

func (c *client) createSchema(ctx context.Context) error {
	return pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = "+strconv.Itoa(int(setupTimeout.Milliseconds()))); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", c.lockID("schema")); err != nil {
			return err
		}
		var hasMeta bool
		var relations int
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
			(SELECT count(*) FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace WHERE n.nspname = $2)`,
			pgx.Identifier{c.cfg.Schema, "meta"}.Sanitize(), c.cfg.Schema).Scan(&hasMeta, &relations); err != nil {
			return err
		}
		if !hasMeta && relations > 0 {
			return fmt.Errorf("%w: postgres.schema %q holds %d tables or indexes but no onceproxy meta table: it is not onceproxy's; name another schema", errSchema, c.cfg.Schema, relations)
		}
		if hasMeta {
			var v string
			err := tx.QueryRow(ctx, schemaSQL(c.cfg.Schema, `SELECT value FROM {s}.meta WHERE name = 'schema_version'`)).Scan(&v)
			if errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("%w: postgres.schema %q has a meta table without a schema_version row", errSchema, c.cfg.Schema)
			}
			if err != nil {
				return err
			}
			if v != strconv.Itoa(schemaVersion) {
				return fmt.Errorf("%w: postgres.schema %q holds onceproxy schema version %q; this onceproxy reads and writes version %d only: point it at another schema (postgres.schema) or drop that one",
					errSchema, c.cfg.Schema, v, schemaVersion)
			}
		}
		// CREATE SCHEMA IF NOT EXISTS asks for the database's CREATE
		// privilege before it looks: a role given its schema by a DBA,
		// and no more, would never get past it.
		stmts := schemaSQL(c.cfg.Schema, `
DO $do$ BEGIN
	IF to_regnamespace('{s}') IS NULL THEN CREATE SCHEMA {s}; END IF;
END $do$;
CREATE TABLE IF NOT EXISTS {s}.meta (name text PRIMARY KEY, value text NOT NULL);
INSERT INTO {s}.meta (name, value) VALUES ('schema_version', '`+strconv.Itoa(schemaVersion)+`') ON CONFLICT (name) DO NOTHING;
`+ddl)
		// No arguments: the simple protocol, which runs the whole script.
		_, err := tx.Exec(ctx, stmts)
		return err
	})
}

// checkSchema is the breaker's probe: the version row, read back. A schema
// dropped by hand while running is created again.
func (c *client) checkSchema(ctx context.Context) error {
	var v string
	err := c.pool.QueryRow(ctx, c.sql.version).Scan(&v)
	switch {
	case err == nil && v == strconv.Itoa(schemaVersion):
		return nil
	case err == nil, errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: postgres.schema %q now holds schema version %q, not %d", errSchema, c.cfg.Schema, v, schemaVersion)
	case isUndefined(err):
		return c.setup(ctx)
	}
	return err
}
