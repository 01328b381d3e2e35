# Source me, then: new_torch_venv VENV [MAIN_VENV]
# Creates VENV with Python 3.11 and torch==2.13.0 (the CPU wheel on local disk) installed first, so that nothing
# installed later pulls a CUDA build. Unpacking torch takes minutes on CI; when MAIN_VENV (default .venv) holds the
# same build, its files are hard-linked instead (same files, no copy; pip then only adds torch's small dependencies).
new_torch_venv() {
  local venv="$1" main_sp="${2:-.venv}/lib/python3.11/site-packages" sp d
  python3.11 -m venv "$venv"
  sp="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ -d "$main_sp/torch-2.13.0+cpu.dist-info" ]]; then
    for d in torch torchgen functorch torch-2.13.0+cpu.dist-info; do
      if [[ -e "$main_sp/$d" ]] && ! cp -al "$main_sp/$d" "$sp/" 2>/dev/null; then
        rm -rf "$sp"/torch "$sp"/torchgen "$sp"/functorch "$sp"/torch-2.13.0+cpu.dist-info  # other filesystem
        break
      fi
    done
  fi
  # compiled at install (torch's dependencies; torch's own files come compiled from MAIN_VENV): under
  # PYTHONDONTWRITEBYTECODE=1, as on CI, every process would compile sympy again (torch._dynamo imports it)
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
}
