#!/usr/bin/env bash
# Runs a command in a fresh memory cgroup whose limit covers anonymous memory AND page cache, so
# a model "larger than memory" really is larger than the memory it may use (REFERENCES.md §7).
#
#   bench/with-memory-limit.sh SIZE CMD [ARGS...]
#
# SIZE: bytes, or a number with a binary suffix K, M, G, T (also KiB/MiB/GiB/TiB): 4G = 4 GiB.
# The group is created as a child of the caller's own memory cgroup (so it nests inside whatever
# limit the caller already has), the command runs in it, and the group is removed afterwards.
# Exit status: the command's (128 + signal if it was killed, e.g. 137 for the OOM killer).
#
# cgroup v2 is used when /sys/fs/cgroup/cgroup.controllers (or /sys/fs/cgroup/unified's) lists
# `memory`; otherwise cgroup v1 at /sys/fs/cgroup/memory. v1: memory.limit_in_bytes (and
# memory.memsw.limit_in_bytes when present, so swap cannot extend it). v2: memory.max, with
# memory.swap.max = 0.
#
# Environment:
#   WITH_MEMORY_LIMIT_REPORT=FILE  write {"cgroup_version","limit_bytes","peak_bytes","oom_kills",
#                                  "exit_status"} as JSON to FILE after the command ends.
#   WITH_MEMORY_LIMIT_QUIET=1      no summary line on stderr.
set -euo pipefail

die() {
	echo "with-memory-limit: error: $*" >&2
	exit 2
}

[[ $# -ge 2 ]] || die "usage: $0 SIZE CMD [ARGS...]   (SIZE e.g. 4G, 512M, 2147483648)"
size_arg=$1
shift

parse_size() {
	local s=$1 num unit mult
	if [[ ! $s =~ ^([0-9]+)([KkMmGgTt]?)(i?[Bb])?$ ]]; then
		return 1
	fi
	num=${BASH_REMATCH[1]}
	unit=${BASH_REMATCH[2]^^}
	case $unit in
	"") mult=1 ;;
	K) mult=$((1 << 10)) ;;
	M) mult=$((1 << 20)) ;;
	G) mult=$((1 << 30)) ;;
	T) mult=$((1 << 40)) ;;
	esac
	echo $((num * mult))
}
limit=$(parse_size "$size_arg") || die "cannot parse SIZE '$size_arg' (use bytes or e.g. 512M, 4G)"
((limit >= 1 << 20)) || die "SIZE '$size_arg' is below 1 MiB; refusing (the command could not even start)"

[[ $(id -u) -eq 0 ]] || die "must run as root to create a memory cgroup (try: sudo $0 $size_arg ...)"

has_memory_controller() { [[ -r $1/cgroup.controllers ]] && grep -qw memory "$1/cgroup.controllers"; }

version=""
if has_memory_controller /sys/fs/cgroup; then
	version=2
	root=/sys/fs/cgroup
elif has_memory_controller /sys/fs/cgroup/unified; then
	version=2
	root=/sys/fs/cgroup/unified
elif [[ -w /sys/fs/cgroup/memory/memory.limit_in_bytes || -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]]; then
	version=1
	root=/sys/fs/cgroup/memory
else
	die "no cgroup memory controller found (looked for v2 at /sys/fs/cgroup and /sys/fs/cgroup/unified, v1 at /sys/fs/cgroup/memory)"
fi

# The caller's own cgroup: v2 line "0::/path", v1 line "N:memory:/path" (or "N:...,memory,...:").
if [[ $version == 2 ]]; then
	own=$(awk -F: '$1 == "0" && $2 == "" { print $3; exit }' /proc/self/cgroup)
else
	own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ { print $3; exit }' /proc/self/cgroup)
fi
parent=$root${own%/}
[[ -d $parent ]] || die "own cgroup directory $parent does not exist"
group=$parent/deltafin-limit.$$
mkdir "$group" 2>/dev/null || die "cannot create cgroup $group (read-only cgroup mount?)"

child=""
# shellcheck disable=SC2329 # invoked by the EXIT trap
cleanup() {
	local rc=$?
	if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then
		kill -TERM "$child" 2>/dev/null || true
		wait "$child" 2>/dev/null || true
	fi
	# Charges (page cache) are moved to the parent on removal; retry while the last task exits.
	for _ in 1 2 3 4 5 6 7 8 9 10; do
		rmdir "$group" 2>/dev/null && break
		sleep 0.1
	done
	[[ -d $group ]] && echo "with-memory-limit: warning: could not remove $group" >&2
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ $version == 2 ]]; then
	if ! grep -qw memory "$group/cgroup.controllers" 2>/dev/null; then
		echo +memory >"$parent/cgroup.subtree_control" 2>/dev/null ||
			die "cgroup v2: cannot enable the memory controller for children of $parent (a v2 group with processes cannot delegate controllers; run from a leaf-free parent, e.g. a systemd-run scope)"
	fi
	echo "$limit" >"$group/memory.max" || die "cannot write $group/memory.max"
	[[ -e $group/memory.swap.max ]] && echo 0 >"$group/memory.swap.max"
	usage() { cat "$group/memory.current"; }
else
	echo "$limit" >"$group/memory.limit_in_bytes" || die "cannot write $group/memory.limit_in_bytes"
	# memsw must be >= limit_in_bytes; setting it equal forbids swapping past the limit.
	if [[ -e $group/memory.memsw.limit_in_bytes ]]; then
		echo "$limit" >"$group/memory.memsw.limit_in_bytes" 2>/dev/null || true
	fi
	usage() { cat "$group/memory.usage_in_bytes"; }
fi
actual=$(cat "$group/memory.max" 2>/dev/null || cat "$group/memory.limit_in_bytes")
[[ $actual == "$limit" || $actual -le $limit ]] || die "limit not applied: wrote $limit, group reports $actual"

# The subshell moves itself into the group, then becomes the command.
(
	echo "$BASHPID" >"$group/cgroup.procs"
	exec "$@"
) &
child=$!
set +e
wait "$child"
status=$?
set -e
child=""

if [[ $version == 2 ]]; then
	peak=$(cat "$group/memory.peak" 2>/dev/null || usage)
	ooms=$(awk '$1 == "oom_kill" { print $2 }' "$group/memory.events" 2>/dev/null)
else
	peak=$(cat "$group/memory.max_usage_in_bytes")
	ooms=$(awk '$1 == "oom_kill" { print $2 }' "$group/memory.oom_control" 2>/dev/null)
	[[ -n $ooms ]] || ooms=$(cat "$group/memory.failcnt")
fi
ooms=${ooms:-0}

if [[ ${WITH_MEMORY_LIMIT_QUIET:-0} != 1 ]]; then
	printf 'with-memory-limit: cgroup v%s limit %s (%d bytes), peak usage %.1f MiB incl. page cache, OOM kills %s, exit %s\n' \
		"$version" "$size_arg" "$limit" "$(awk -v p="$peak" 'BEGIN { print p / 1048576 }')" "$ooms" "$status" >&2
fi
if ((ooms > 0)); then
	echo "with-memory-limit: the command was killed by the OOM killer: it needed more than $size_arg" >&2
fi
if [[ -n ${WITH_MEMORY_LIMIT_REPORT:-} ]]; then
	printf '{"cgroup_version":%s,"limit_bytes":%s,"peak_bytes":%s,"oom_kills":%s,"exit_status":%s}\n' \
		"$version" "$limit" "$peak" "$ooms" "$status" >"$WITH_MEMORY_LIMIT_REPORT"
fi
exit "$status"
