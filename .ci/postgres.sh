# Sourced by .ci/run: start a throwaway PostgreSQL server on 127.0.0.1 for the
# database tests, and export KVSPLIT_TEST_PG_URL pointing at an empty database.
#
# Never fails the CI run by itself: if no server can be started it says why,
# leaves KVSPLIT_TEST_PG_URL unset, and the PostgreSQL tests skip (visibly).
# Safe under `set -euo pipefail`: all the work runs in a function called from
# an `||` list, where errexit does not apply.  Stop the server with
# `kvsplit_pg_stop` (e.g. `trap kvsplit_pg_stop EXIT` in .ci/run).

_kvsplit_pg_bindir() {
    local dir found=""
    # Debian's layout; the last (lexically highest) version wins.
    for dir in /usr/lib/postgresql/*/bin; do
        [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && found="$dir"
    done
    if [ -z "$found" ] && command -v pg_ctl >/dev/null 2>&1; then
        dir="$(dirname "$(readlink -f "$(command -v pg_ctl)")")"
        [ -x "$dir/initdb" ] && found="$dir"
    fi
    [ -n "$found" ] && echo "$found"
}

_kvsplit_pg_start() {
    local bindir user run dir port log
    bindir="$(_kvsplit_pg_bindir)" || true
    if [ -z "$bindir" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "postgres.sh: installing PostgreSQL (apt-get install postgresql)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } \
            >/tmp/kvsplit-pg-apt.log 2>&1 || echo "postgres.sh: apt-get failed, see /tmp/kvsplit-pg-apt.log"
        bindir="$(_kvsplit_pg_bindir)" || true
    fi
    if [ -z "$bindir" ]; then
        echo "postgres.sh: no PostgreSQL binaries found; PostgreSQL tests will be skipped"
        return 1
    fi

    # The server refuses to run as root: run it as the postgres user.
    user="$(id -un)"
    run=()
    if [ "$(id -u)" = 0 ]; then
        user=postgres
        id -u "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user" \
            || { echo "postgres.sh: cannot create user $user"; return 1; }
        run=(runuser -u "$user" --)
    fi

    dir="$(mktemp -d /tmp/kvsplit-pg.XXXXXX)" || return 1
    chown "$user" "$dir" || return 1
    log="$dir/server.log"
    # An unused port, chosen by the kernel.
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
        || { echo "postgres.sh: cannot pick a port"; return 1; }

    # cd: the server's user may not be able to enter the caller's directory.
    if ! (cd "$dir" && "${run[@]}" "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync \
            >"$dir/initdb.log" 2>&1); then
        echo "postgres.sh: initdb failed:"; tail -n 5 "$dir/initdb.log"; return 1
    fi
    # Durability is pointless for a throwaway test server; speed matters.
    if ! (cd "$dir" && "${run[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100" \
            start >"$dir/pg_ctl.log" 2>&1); then
        echo "postgres.sh: server did not start:"; tail -n 5 "$log" 2>/dev/null; return 1
    fi
    if ! (cd "$dir" && "${run[@]}" "$bindir/createdb" -h 127.0.0.1 -p "$port" -U postgres kvsplit_test \
            >>"$dir/pg_ctl.log" 2>&1); then
        echo "postgres.sh: createdb failed:"; tail -n 5 "$dir/pg_ctl.log"; return 1
    fi

    KVSPLIT_PG_DIR="$dir"
    KVSPLIT_PG_CTL=("${run[@]}" "$bindir/pg_ctl" -D "$dir/data")
    export KVSPLIT_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$port/kvsplit_test"
    echo "postgres.sh: PostgreSQL $("$bindir/postgres" --version | awk '{print $3}') on 127.0.0.1:$port (data in $dir)"
}

kvsplit_pg_stop() {
    if [ -n "${KVSPLIT_PG_DIR:-}" ]; then
        (cd "$KVSPLIT_PG_DIR" && "${KVSPLIT_PG_CTL[@]}" stop -m fast >/dev/null 2>&1) || true
        rm -rf "$KVSPLIT_PG_DIR"
        KVSPLIT_PG_DIR=""
    fi
    unset KVSPLIT_TEST_PG_URL
}

unset KVSPLIT_TEST_PG_URL
_kvsplit_pg_start || echo "postgres.sh: continuing without PostgreSQL"
