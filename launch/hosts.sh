#!/usr/bin/env bash
# Two emulated hosts on this machine, for DeepSpeed's plain multi-node launch (pdsh over ssh).
#   launch/hosts.sh up [RATE] [CORES]   # RATE as tc writes it (100mbit, 1gbit; "none": no limit, the default).
#                               # CORES: confine each host to that many cores of its own, which its sshd and
#                               # everything it starts inherit: a cpuset group of cgroup v2 where the machine
#                               # has it, else of cgroup v1, else the CPU affinity (nshard/cgroups.py;
#                               # NSHARD_PLACEMENT_PIN=v2|v1|affinity forces one); default: no confinement.
#                               # Prints the hostfile; runs/hosts/pin-<i> says how host i was pinned.
#   launch/hosts.sh rate RATE   # change the limit of a running pair ("none" removes it)
#   launch/hosts.sh down        # remove everything `up` made, also after a crashed `up`
# Root only. Each host is a network namespace whose eth0 (198.51.100.1 and .2, documentation range)
# is one end of a veth; the other ends sit on a bridge in the root namespace (198.51.100.254), so
# the launcher here can ssh to both. Each namespace runs its own sshd on its address, accepting only
# a key made here. The ssh config is reached through an Include line at the top of ~/.ssh/config.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
state=$repo/runs/hosts
hosts=(1 2)
net=198.51.100
bridge=nshard-br
ns() { echo "nshard-h$1"; }
groups=(nshard-h1 nshard-h2)  # host i's cpuset group (v2 or v1), when `up` was given CORES and a cgroup pins them
cg() { PYTHONPATH="$repo" python3 -m nshard.cgroups "$@"; }
veth() { echo "nshard-v$1"; }  # the root-namespace end; the namespace's end is eth0
include="Include $state/ssh_config"
user_config=$HOME/.ssh/config

die() { echo "hosts.sh: $*" >&2; exit 2; }

shape() {  # shape NS RATE: tbf on the namespace's eth0 (its transmit side); RATE "none" removes it
  local target=$1 rate=$2
  ip netns exec "$target" tc qdisc del dev eth0 root 2>/dev/null || true
  [ "$rate" = none ] && return 0
  # A bucket of 64 KiB or 2 ms of the rate, whichever is larger: the 64 KiB measured 102.9 Mbit/s at
  # 100mbit (FACTS.md); faster rates need a deeper bucket to reach their rate.
  local burst
  burst=$(awk -v r="$rate" 'BEGIN { n = r + 0; u = substr(r, length(n "") + 1);
    m = (u ~ /^g/) ? 1e9 : (u ~ /^m/) ? 1e6 : (u ~ /^k/) ? 1e3 : 1; if (u ~ /bps$/) m *= 8;
    b = n * m / 8 * 0.002; if (b < 65536) b = 65536; printf "%d", b }')
  ip netns exec "$target" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
}

check_rate() {
  [[ $1 =~ ^[0-9]+(\.[0-9]+)?([kmgt]?bit|[kmgt]?bps)$ ]] || die "rate '$1' is not a tc rate: use e.g. 100mbit or 1gbit"
}

check_cores() {  # check_cores N: N whole cores per host, this machine (its affinity) has 2N, and a way to pin them
  [[ $1 =~ ^[1-9][0-9]*$ ]] || die "cores per host '$1' is not a whole number of cores (e.g. 1)"
  local have pin
  pin=$(cg mode cpuset 2>&1) || die "${pin#cgroups: error: }"
  pin_mode=${pin%% *}
  have=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
  [ $(( $1 * ${#hosts[@]} )) -le "$have" ] \
    || die "$1 cores for each of ${#hosts[@]} hosts needs $(( $1 * ${#hosts[@]} )) cores; this machine has $have"
}

confine() {  # confine I N: host I's sshd (and all it starts) on cores (I-1)*N .. I*N-1 of this machine's
  local i=$1 n=$2 pid tries=50 cores how
  cores=$(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); print(','.join(map(str, c[($i - 1) * $n:$i * $n])))")
  until pid=$(cat "$state/sshd-$i.pid" 2>/dev/null) && [ -n "$pid" ]; do  # sshd writes it once it listens
    tries=$((tries - 1)); [ "$tries" -gt 0 ] || die "sshd of host $i wrote no pid file"; sleep 0.1
  done
  how=$(cg pin "$pin_mode" "${groups[$((i - 1))]}" "$cores" "$pid" --state "$state" 2>&1) || die "${how#cgroups: error: }"
  echo "$cores" > "$state/cores-$i"
  echo "$how" > "$state/pin-$i"
}

up() {
  local rate=${1:-none} cores=${2:-}
  [ "$rate" = none ] || check_rate "$rate"
  [ -z "$cores" ] || check_cores "$cores"
  command -v pdsh >/dev/null && [ -x /usr/sbin/sshd ] \
    || die "needs Debian's pdsh and openssh-server: run launch/setup.sh as root (or apt-get install pdsh openssh-server)"
  if leftovers; then die "an earlier pair is still (partly) up: run launch/hosts.sh down first"; fi
  trap failed_up EXIT
  trap 'exit 130' INT TERM
  mkdir -p "$state" && chmod 700 "$state"
  ssh-keygen -q -t ed25519 -N '' -C nshard-hosts-client -f "$state/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -C nshard-hosts-host -f "$state/host_key"
  cp "$state/id_ed25519.pub" "$state/authorized_keys"
  ip link add "$bridge" type bridge
  echo 1 > "/proc/sys/net/ipv6/conf/$bridge/disable_ipv6"  # no router solicitations in the counters
  ip addr add "$net.254/24" dev "$bridge"
  ip link set "$bridge" up
  mkdir -p /run/sshd  # sshd's privilege-separation directory
  for i in "${hosts[@]}"; do
    ip netns add "$(ns "$i")"
    ip link add "$(veth "$i")" type veth peer name eth0 netns "$(ns "$i")"
    ip link set "$(veth "$i")" master "$bridge" up
    ip netns exec "$(ns "$i")" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
    ip -n "$(ns "$i")" addr add "$net.$i/24" dev eth0
    ip -n "$(ns "$i")" link set lo up
    ip -n "$(ns "$i")" link set eth0 up
    shape "$(ns "$i")" "$rate"
    start_sshd "$i"
    [ -z "$cores" ] || confine "$i" "$cores"
  done
  write_configs
  for i in "${hosts[@]}"; do wait_for_ssh "$net.$i"; done
  trap - EXIT INT TERM
  echo "$state/hostfile"
}

failed_up() {  # whatever stopped `up` (an error, Ctrl-C), nothing it made stays behind
  echo "hosts.sh: up failed (status $?); tearing down" >&2
  (down) >/dev/null 2>&1 || echo "hosts.sh: teardown incomplete; run launch/hosts.sh down" >&2
}

start_sshd() {  # one sshd per namespace, on its address only, accepting only our key
  local i=$1
  # SetEnv is what differs on these hosts from the launcher's: gloo must use eth0 (the hostname
  # resolves to loopback), one OpenMP thread (two "hosts" share two cores), the venv's tools on PATH.
  # AcceptEnv takes the launcher's NSHARD_* variables (the ssh config sends them).
  ip netns exec "$(ns "$i")" /usr/sbin/sshd -f /dev/null \
    -o ListenAddress="$net.$i" -o Port=22 -o HostKey="$state/host_key" -o PidFile="$state/sshd-$i.pid" \
    -o AuthorizedKeysFile="$state/authorized_keys" -o PermitRootLogin=prohibit-password \
    -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no -o StrictModes=no -o UsePAM=no \
    -o AcceptEnv='NSHARD_*' \
    -o SetEnv="GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 PATH=$repo/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}

write_configs() {
  : > "$state/known_hosts"
  {
    for i in "${hosts[@]}"; do
      printf 'Host %s\n  User root\n  IdentityFile %s\n  IdentitiesOnly yes\n  UserKnownHostsFile %s\n' \
        "$net.$i" "$state/id_ed25519" "$state/known_hosts"
      printf '  StrictHostKeyChecking accept-new\n  SendEnv NSHARD_*\n  LogLevel ERROR\n'
    done
  } > "$state/ssh_config"
  for i in "${hosts[@]}"; do echo "$net.$i slots=1"; done > "$state/hostfile"
  for i in "${hosts[@]}"; do printf '%s\t%s\t%s\n' "$(ns "$i")" "$net.$i" "$(veth "$i")"; done > "$state/hosts.tsv"
  # DeepSpeed runs plain `ssh HOST ...`, so only the user's own config can name key and known-hosts.
  # The Include goes first: below a Host block it would apply to that block only.
  [ -d "$HOME/.ssh" ] || { mkdir -m 700 "$HOME/.ssh"; touch "$state/created-ssh-dir"; }
  [ -f "$user_config" ] || { : > "$user_config"; chmod 600 "$user_config"; touch "$state/created-ssh-config"; }
  { echo "$include"; cat "$user_config"; } > "$user_config.nshard-tmp"
  cat "$user_config.nshard-tmp" > "$user_config" && rm "$user_config.nshard-tmp"
}

wait_for_ssh() {
  local host=$1 tries=50
  until ssh -o BatchMode=yes -o ConnectTimeout=2 "$host" true 2>/dev/null; do
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || { ssh -o BatchMode=yes -o ConnectTimeout=2 "$host" true || true; die "no ssh to $host"; }
    sleep 0.2
  done
}

leftovers() {  # true when anything `up` makes is still there
  local i
  for i in "${hosts[@]}"; do
    [ -e "/run/netns/$(ns "$i")" ] && return 0
    ip link show "$(veth "$i")" >/dev/null 2>&1 && return 0
  done
  ip link show "$bridge" >/dev/null 2>&1 && return 0
  [ -n "$(cg groups "${groups[@]}")" ] && return 0
  [ -f "$user_config" ] && grep -qxF "$include" "$user_config" && return 0
  [ -e "$state" ]
}

alive() {  # alive PID...: true while any of them runs (a zombie has finished: its parent reaps it)
  local pid
  for pid in "$@"; do
    [ -r "/proc/$pid/stat" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] && return 0
  done
  return 1
}

down() {
  local i pid pids=()
  # Everything `up` started: each sshd by its pid file, and whatever runs in the namespaces (sshd's
  # sessions, ranks). Stop them all and wait for exactly those PIDs, or the namespace and its veth
  # outlive `ip netns del`, and an sshd can still be serving after `down` returned.
  for i in "${hosts[@]}"; do
    # (a pid file left by a crash may name a reused PID: take it only while it is still our sshd)
    pid=$(cat "$state/sshd-$i.pid" 2>/dev/null || true)
    [ -n "$pid" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$state/sshd-$i.pid" && pids+=("$pid")
    [ -e "/run/netns/$(ns "$i")" ] && pids+=($(ip netns pids "$(ns "$i")" 2>/dev/null || true))
  done
  pids+=($(cg pids "${groups[@]}" 2>/dev/null || true))
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do alive "${pids[@]}" || break; sleep 0.1; done
    kill -9 "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do alive "${pids[@]}" || break; sleep 0.1; done
    alive "${pids[@]}" && die "processes ${pids[*]} would not stop"
  fi
  for i in "${hosts[@]}"; do
    [ -e "/run/netns/$(ns "$i")" ] && ip netns del "$(ns "$i")"
    ip link del "$(veth "$i")" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  if [ -f "$user_config" ]; then
    grep -vxF "$include" "$user_config" > "$user_config.nshard-tmp" || true
    cat "$user_config.nshard-tmp" > "$user_config" && rm "$user_config.nshard-tmp"
    if [ -f "$state/created-ssh-config" ] && [ ! -s "$user_config" ]; then rm "$user_config"; fi
  fi
  if [ -f "$state/created-ssh-dir" ]; then rmdir "$HOME/.ssh" 2>/dev/null || true; fi
  cg remove "${groups[@]}" --state "$state" || true  # each once its last process has exited (retried)
  rm -rf "$state"
  for _ in $(seq 50); do
    leftovers || return 0
    sleep 0.1
  done
  die "could not remove everything (see: ip netns list; ip link show $bridge; python3 -m nshard.cgroups groups ${groups[*]})"
}

[ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth, tc, sshd)"
mkdir -p /run/lock
exec 9> /run/lock/nshard-hosts.lock
flock -w 120 9 || die "another launch/hosts.sh is running"
case "${1:-}" in
  up) up "${2:-}" "${3:-}" ;;
  down) down ;;
  rate)
    [ -n "${2:-}" ] || die "usage: launch/hosts.sh rate RATE|none"
    [ "$2" = none ] || check_rate "$2"
    for i in "${hosts[@]}"; do
      [ -e "/run/netns/$(ns "$i")" ] || die "the hosts are not up: run launch/hosts.sh up first"
      shape "$(ns "$i")" "$2"
    done ;;
  *) die "usage: launch/hosts.sh up [RATE|none] [CORES] | rate RATE|none | down" ;;
esac
