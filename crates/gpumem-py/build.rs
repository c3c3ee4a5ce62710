//! Builds the C++ shim (shim/torch_shim.cpp): it throws the C++ exceptions through which an
//! allocation failure reaches PyTorch, and binds c10::OutOfMemoryError at run time.

fn main() {
    println!("cargo:rerun-if-changed=shim/torch_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/torch_shim.cpp")
        .warnings(true)
        .compile("gpumem_torch_shim");
    // dlopen/dlsym: in libc since glibc 2.34, in libdl before.
    println!("cargo:rustc-link-lib=dl");
}
