"""Read-only user SQL, enforced by the engines themselves.

SQLite: an authorizer callback (``sqlite3.Connection.set_authorizer``) on top of
``PRAGMA query_only``: the engine asks it about every action while compiling a
statement, and it allows only reads, transactions, introspection pragmas and functions from
a list of known-safe ones (``SAFE_SQLITE_FUNCTIONS``: the core, date, math, window and JSON
functions). Anything else is refused by name: ``fts3_tokenizer()`` registers a tokenizer at
a pointer of the query's choosing (and leaks a heap address), ``load_extension()`` loads
code, and a function an extension or a later SQLite adds is not trusted before it is
looked at. ``ATTACH`` (which creates files anywhere, and is how ``VACUUM INTO`` writes) is
denied.

PostgreSQL: a ``READ ONLY`` transaction that is always rolled back, never committed, so
transactional side effects that a read-only transaction still allows (large objects made
or unlinked by ``lo_from_bytea``/``lo_unlink``, ``set_config``, ``NOTIFY``) vanish. What
a rollback cannot undo (signalling other sessions, reloading the configuration, server
files, advisory locks kept by the pooled session, connections to elsewhere) is refused
before the statement is sent: only a query statement is accepted, and it may not name a
server function with side effects or one that runs SQL given as text (a list), nor any
function the server's catalog marks VOLATILE outside a few that only compute or wait (the
general rule, ``pg_check_volatile``: what an extension adds is covered by it). A dedicated
restricted role would also stop these, but it needs CREATEROLE and is cluster-wide, so
it is not something a ``sql`` command can set up on a user's server.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from hcapo_store.errors import StoreError

WRITE_HINT = "read-only: {what} is not allowed (add --write to modify the database)"

# ---- SQLite ------------------------------------------------------------------------------------

_ALLOWED_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_RECURSIVE,
    sqlite3.SQLITE_TRANSACTION,
    sqlite3.SQLITE_SAVEPOINT,
}
# Functions that only compute a value from their arguments (or read the clock, the version or
# a random number). Out on purpose: fts3_tokenizer, load_extension, the FTS3/4/5 and R-Tree
# helpers (they parse blobs the query supplies), sqlite_log, and anything not named here.
SAFE_SQLITE_FUNCTIONS = frozenset(
    """
    abs changes char coalesce concat concat_ws format glob hex ifnull iif if instr last_insert_rowid length
    like likelihood likely lower ltrim max min nullif octet_length printf quote random randomblob replace
    round rtrim sign soundex substr substring total_changes trim typeof unhex unicode unlikely upper zeroblob
    sqlite_version sqlite_source_id sqlite_compileoption_get sqlite_compileoption_used
    avg count group_concat string_agg sum total median
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    date time datetime julianday unixepoch strftime timediff current_date current_time current_timestamp
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod pi
    pow power radians sin sinh sqrt tan tanh trunc
    json json_array json_array_length json_error_position json_extract json_group_array json_group_object
    json_insert json_object json_patch json_pretty json_quote json_remove json_replace json_set json_type
    json_valid json_each json_tree -> ->>
    """.split()
)
# Pragmas that only describe the schema or check it; any argument is a table/index name.
_INTROSPECTION_PRAGMAS = {
    "table_info",
    "table_xinfo",
    "table_list",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "foreign_key_check",
    "integrity_check",
    "quick_check",
    "function_list",
    "pragma_list",
    "collation_list",
    "module_list",
    "database_list",
    "compile_options",
}
# Pragmas that only read a setting when given no value (with a value they change it).
_SETTING_PRAGMAS = {
    "user_version",
    "schema_version",
    "application_id",
    "page_count",
    "page_size",
    "freelist_count",
    "journal_mode",
    "encoding",
    "foreign_keys",
    "query_only",
    "data_version",
    "cache_size",
    "busy_timeout",
    "synchronous",
    "auto_vacuum",
    "max_page_count",
}
_ACTIONS = (
    "CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE CREATE_TEMP_TRIGGER CREATE_TEMP_VIEW "
    "CREATE_TRIGGER CREATE_VIEW DELETE DROP_INDEX DROP_TABLE DROP_TEMP_INDEX DROP_TEMP_TABLE "
    "DROP_TEMP_TRIGGER DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT UPDATE ATTACH DETACH ALTER_TABLE "
    "REINDEX ANALYZE CREATE_VTABLE DROP_VTABLE"
).split()
_ACTION_NAMES = {getattr(sqlite3, f"SQLITE_{a}"): a.replace("_", " ") for a in _ACTIONS}


class _SqliteGuard:
    """The authorizer; remembers what it denied so the error can name it."""

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in SAFE_SQLITE_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_UPDATE and arg1 in ("sqlite_master", "sqlite_temp_master"):
            # Asked while SQLite reloads its schema (e.g. for pragma_table_info()); changing the
            # schema table needs writable_schema, a pragma refused below, and query_only holds.
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in _INTROSPECTION_PRAGMAS or (name in _SETTING_PRAGMAS and arg2 is None):
                return sqlite3.SQLITE_OK
            what = f"PRAGMA {name}" + (f" = {arg2}" if arg2 is not None else "")
        elif action == sqlite3.SQLITE_FUNCTION:
            what = f"{arg2}() (not on the list of functions read-only SQL may call)"
        else:
            what = _ACTION_NAMES.get(action, f"action {action}") + (f" {arg1}" if arg1 else "")
        self.denied = self.denied or what  # the first refusal is the statement's own
        return sqlite3.SQLITE_DENY


def sqlite_enter(raw: sqlite3.Connection) -> _SqliteGuard:
    raw.execute("PRAGMA query_only = ON")
    guard = _SqliteGuard()
    raw.set_authorizer(guard)
    return guard


def sqlite_leave(raw: sqlite3.Connection) -> None:
    raw.set_authorizer(None)
    raw.execute("PRAGMA query_only = OFF")


def sqlite_error(guard: _SqliteGuard, exc: BaseException) -> StoreError | None:
    """The read-only refusal behind a "not authorized" error, if it was one."""
    if guard.denied is None or "not authorized" not in str(exc):
        return None
    return StoreError(WRITE_HINT.format(what=guard.denied))


# ---- PostgreSQL --------------------------------------------------------------------------------

_QUERY_KEYWORDS = {"select", "with", "values", "table", "show", "explain"}
_LEADING = re.compile(r"(\s+|--[^\n]*(\n|$)|/\*.*?\*/|\()*", re.S)
# Server functions whose effects a rollback does not undo (or that run SQL given as text,
# which could name them out of sight of this check).
_SIDE_EFFECTS = re.compile(
    r"\b(lo_(import|export|unlink|from_bytea|creat|create|put|truncate\w*|open|close|lseek\w*|tell\w*)|loread|lowrite"
    r"|pg_terminate_backend|pg_cancel_backend|pg_reload_conf|pg_rotate_logfile\w*"
    r"|set_config|pg_(try_)?advisory\w*|dblink\w*|pg_read_(binary_)?file|pg_ls_\w+|pg_stat_file|pg_file_\w+"
    r"|pg_logdir_ls|pg_switch_(wal|xlog)|pg_create_restore_point|pg_promote|pg_\w*replication_\w+"
    r"|pg_logical_emit_message|pg_stat_reset\w*|pg_(start|stop)_backup|pg_backup_(start|stop)"
    r"|pg_wal_replay_\w+|pg_import_system_collations|pg_log_backend_memory_contexts|pg_notify"
    r"|query_to_xml\w*|ts_stat|ts_rewrite|nextval|setval)\b",
    re.I,
)


def pg_check(sql: str) -> None:
    """Refuse, before sending, what a rolled-back READ ONLY transaction would not contain."""
    body = sql[_LEADING.match(sql).end() :]  # type: ignore[union-attr]
    keyword = re.match(r"[A-Za-z]+", body)
    if keyword is None or keyword.group(0).lower() not in _QUERY_KEYWORDS:
        first = keyword.group(0).upper() if keyword else body[:20]
        raise StoreError(
            WRITE_HINT.format(
                what=f"a {first} statement (only SELECT, WITH, VALUES, TABLE, SHOW and EXPLAIN are read-only)"
            )
        )
    if re.search(r"\bU&['\"]", sql, re.I):
        raise StoreError(WRITE_HINT.format(what='a Unicode-escaped name (U&"…")'))
    hit = _SIDE_EFFECTS.search(sql)
    if hit:
        raise StoreError(WRITE_HINT.format(what=f"{hit.group(0)}() (a server function with side effects)"))


def pg_enter(conn: Any) -> None:
    conn.exec_driver_sql("SET TRANSACTION READ ONLY")


# The general rule beside the list above: a word of the statement that names a VOLATILE
# function on the server is refused, unless it is one of these, which only compute or wait.
# PostgreSQL marks a function VOLATILE when it may change something or its result may change
# within a statement; functions whose effect a rollback cannot undo are volatile (an
# extension's function is VOLATILE unless its author said otherwise): consuming a logical
# replication slot (pg_logical_slot_get_changes), resetting pg_stat_statements, writing
# autoprewarm's file. The check is the server's own catalog, so what a new extension adds is
# covered without knowing its name. An allowlist of every function read-only SQL may call
# would refuse hundreds of harmless built-in ones and every operator's function.
SAFE_VOLATILE_PG_FUNCTIONS = frozenset(
    {
        "random",
        "random_normal",
        "gen_random_uuid",
        "clock_timestamp",
        "timeofday",
        "pg_sleep",
        "pg_sleep_for",
        "pg_sleep_until",
    }
)
# Every word and double-quoted name: the words before "(" alone would miss a call written
# with a comment between the name and its parenthesis (a word in a string literal that names a
# volatile function is refused too: one line names it).
_WORDS = re.compile(r'"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_$]*)')


def pg_check_volatile(conn: Any, sql: str) -> None:
    """Refuse a statement that names a VOLATILE server function (the catalog of the server it
    runs on, asked on the statement's own connection) outside ``SAFE_VOLATILE_PG_FUNCTIONS``."""
    names = set()
    for quoted, word in _WORDS.findall(sql):
        names.add(quoted.replace('""', '"') if quoted else word.lower())
    names -= SAFE_VOLATILE_PG_FUNCTIONS
    if not names:
        return
    from sqlalchemy import bindparam, text

    query = text("SELECT DISTINCT proname FROM pg_proc WHERE provolatile = 'v' AND proname IN :names ORDER BY 1")
    hits = conn.execute(query.bindparams(bindparam("names", expanding=True)), {"names": sorted(names)}).scalars().all()
    if hits:
        raise StoreError(
            WRITE_HINT.format(
                what=f"{hits[0]}() (a VOLATILE server function: it may change what a rollback cannot undo)"
            )
        )


# ---- stopping a statement: a time limit and Ctrl-C, on both engines --------------------------


def timeout_message(timeout: float) -> str:
    return f"the query ran longer than {timeout:g} s and was stopped (--timeout SECONDS allows more; 0: no limit)"


class Stoppable:
    """Runs one statement under a time limit, stopped on Ctrl-C.

    SQLite runs the statement in this thread, where Python's own SIGINT handling waits for
    the statement to end (a runaway recursive CTE: for ever): a progress handler, called
    every few thousand VM steps, aborts it once the deadline passes or Ctrl-C was pressed
    (a SIGINT handler installed for the statement only records the press). PostgreSQL:
    ``statement_timeout`` ends it on the server; on Ctrl-C psycopg cancels the server's
    query before raising ``KeyboardInterrupt``.
    """

    PROGRESS_STEPS = 10_000

    def __init__(self, conn: Any, timeout: float | None) -> None:
        self.conn = conn
        self.timeout = timeout if timeout else None  # 0 or None: no limit
        self.deadline = float("inf")
        self.interrupted = False

    def __enter__(self) -> Stoppable:
        if self.conn.dialect.name == "postgresql" and self.timeout is not None:
            # LOCAL: ends with the transaction (always rolled back or committed by query()).
            self.conn.exec_driver_sql(f"SET LOCAL statement_timeout = {max(int(self.timeout * 1000), 1)}")
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, call: Any) -> Any:
        if self.conn.dialect.name != "sqlite":
            try:
                return call()
            except Exception as exc:
                if self.timeout is not None and "statement timeout" in str(exc):
                    raise StoreError(timeout_message(self.timeout)) from exc
                raise
        import time

        raw = self.conn.connection.driver_connection
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout
        raw.set_progress_handler(lambda: int(self.interrupted or time.monotonic() > self.deadline), self.PROGRESS_STEPS)
        previous = _catch_sigint(self)
        try:
            return call()
        except Exception as exc:
            if "interrupted" not in str(exc):
                raise
            if self.interrupted:
                raise KeyboardInterrupt from exc
            assert self.timeout is not None
            raise StoreError(timeout_message(self.timeout)) from exc
        finally:
            raw.set_progress_handler(None, 0)
            _restore_sigint(previous)


def stoppable(conn: Any, timeout: float | None) -> Stoppable:
    return Stoppable(conn, timeout)


def _catch_sigint(stop: Stoppable) -> Any:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None  # only the main thread gets signals (and may install handlers)

    def on_sigint(_signum: int, _frame: Any) -> None:
        stop.interrupted = True

    return signal.signal(signal.SIGINT, on_sigint)


def _restore_sigint(previous: Any) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGINT, previous)
