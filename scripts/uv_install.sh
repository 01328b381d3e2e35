# Source me, then: uv_install VENV PIP_INSTALL_ARGS...
# `pip install PIP_INSTALL_ARGS` into VENV through uv (installed into VENV by pip first, once): uv resolves, fetches
# and unpacks several times faster than pip and compiles the bytecode on both cores (measured on this 2-core host:
# zorro_verl[dev,verl] into a new .venv in 25 s against pip's ~110 s, `pip freeze` identical). uv reads no pip.conf,
# so this machine's pip settings are passed on: PIP_FIND_LINKS (the local torch CPU wheel) and pip's global
# constraints file. Compiled at install (--compile-bytecode): under PYTHONDONTWRITEBYTECODE=1, as on CI, Python never
# caches what it compiles at import, and every test process would compile each module it imports again.
uv_install() {
  local venv="$1" c
  shift
  [[ -x "$venv/bin/uv" ]] || "$venv/bin/python" -m pip install -q "uv==0.13.9"
  local extra=()
  [[ -n "${PIP_FIND_LINKS:-}" ]] && extra+=(--find-links "$PIP_FIND_LINKS")
  c="$("$venv/bin/python" -m pip config list 2>/dev/null | sed -n "s/^global\.constraint='\(.*\)'$/\1/p" | tail -1)"
  [[ -n "$c" && -f "$c" ]] && extra+=(-c "$c")
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" --compile-bytecode "${extra[@]}" "$@"
}
