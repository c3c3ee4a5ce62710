#!/usr/bin/env bash
# Sourced (not run) from the repository root by the device scripts that test the Python package
# (torch.sh, ddp.sh, pydiag.sh): `install_gpumem_wheel SITE` puts the newest gpumem wheel of
# .device/wheels into the folder SITE (emptied first) and SITE first on PYTHONPATH. pip's output
# goes to $OUT/pip.log. Without a wheel it says how to build one and exits the script with 2.
install_gpumem_wheel() {
    local site=$1 wheel
    wheel=$(ls -t .device/wheels/gpumem-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        echo "no wheel in .device/wheels: build it first (maturin build --release --out .device/wheels) and carry .device" >&2
        exit 2
    fi
    rm -rf "$site"
    # A wheel is a zip: if pip refuses (an externally managed Python), unpack it by hand.
    python3 -m pip install --no-index --no-deps --target "$site" "$wheel" >"$OUT/pip.log" 2>&1 \
        || python3 -m zipfile -e "$wheel" "$site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}
