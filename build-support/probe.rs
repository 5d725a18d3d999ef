// Shared by the build scripts of the crates whose tests need something the machine may lack (a
// Vulkan driver, one with f16, `mpirun`, root with iproute2 for network namespaces): `include!`d,
// not a crate, so that no crate gains a build dependency.
//
// For each capability the calling crate's tests need, this sets `--cfg disagmoe_no_<name>` when
// the machine lacks it, so those tests are marked `#[ignore = "<why>"]` and `cargo test` reports
// them as ignored in its summary instead of passing without running. A capability named in
// `DISAGMOE_REQUIRE` (comma-separated: `vulkan,f16,mpi,netns`) is never skipped: its
// tests run, and fail saying what is missing.

/// Directories the Vulkan loader reads driver manifests from (besides `VK_ICD_FILENAMES` /
/// `VK_DRIVER_FILES`).
const VULKAN_ICD_DIRS: &[&str] =
    &["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/usr/local/etc/vulkan/icd.d"];

fn vulkan_driver_present() -> bool {
    let from_env = ["VK_ICD_FILENAMES", "VK_DRIVER_FILES"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|files| std::env::split_paths(&files).any(|p| p.is_file())));
    from_env
        || VULKAN_ICD_DIRS.iter().any(|dir| {
            std::fs::read_dir(dir).is_ok_and(|entries| {
                entries.flatten().any(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
        })
}

/// Whether `vulkaninfo` (Debian's vulkan-tools) reports a device with what wgpu needs for f16
/// shaders: `shaderFloat16` and both 16-bit storage accesses. Without `vulkaninfo` nothing is
/// known, and the f16 tests are ignored saying how to tell.
fn vulkan_f16_present() -> bool {
    let Ok(out) = std::process::Command::new("vulkaninfo").stderr(std::process::Stdio::null()).output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let on = |feature: &str| {
        text.lines().any(|l| {
            let mut kv = l.split('=').map(str::trim);
            kv.next() == Some(feature) && kv.next() == Some("true")
        })
    };
    out.status.success()
        && on("shaderFloat16")
        && on("storageBuffer16BitAccess")
        && on("uniformAndStorageBuffer16BitAccess")
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

/// Reruns the build script when `path` (or, while it does not exist, its nearest existing
/// ancestor) changes: installing a driver later switches the tests on.
fn rerun_if_changed(path: &std::path::Path) {
    let mut p = path;
    while !p.exists() {
        match p.parent() {
            Some(parent) => p = parent,
            None => return,
        }
    }
    println!("cargo:rerun-if-changed={}", p.display());
}

/// Probes each capability in `needs` (`"vulkan"`, `"f16"`: a Vulkan driver with f16, `"mpi"`,
/// `"netns"`: root with `ip` and `tc`) and emits its `disagmoe_no_*` cfg.
fn probe(needs: &[&str]) {
    println!("cargo:rerun-if-env-changed=DISAGMOE_REQUIRE");
    let required: Vec<String> = std::env::var("DISAGMOE_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    for r in &required {
        if !["vulkan", "f16", "mpi", "netns"].contains(&r.as_str()) {
            panic!("DISAGMOE_REQUIRE names `{r}`: the allowed values are vulkan, f16, mpi and netns (comma-separated)");
        }
    }
    for &need in needs {
        println!("cargo:rustc-check-cfg=cfg(disagmoe_no_{need})");
        let present = match need {
            "vulkan" => {
                for v in ["VK_ICD_FILENAMES", "VK_DRIVER_FILES"] {
                    println!("cargo:rerun-if-env-changed={v}");
                }
                VULKAN_ICD_DIRS.iter().for_each(|d| rerun_if_changed(std::path::Path::new(d)));
                vulkan_driver_present()
            }
            "f16" => {
                // The same triggers as the driver's (a driver installed or changed), and PATH
                // for `vulkaninfo` itself.
                for v in ["VK_ICD_FILENAMES", "VK_DRIVER_FILES", "PATH"] {
                    println!("cargo:rerun-if-env-changed={v}");
                }
                VULKAN_ICD_DIRS.iter().for_each(|d| rerun_if_changed(std::path::Path::new(d)));
                if let Some(paths) = std::env::var_os("PATH") {
                    std::env::split_paths(&paths)
                        .filter(|d| d.starts_with("/usr") || d.starts_with("/opt"))
                        .for_each(|d| rerun_if_changed(&d));
                }
                vulkan_driver_present() && vulkan_f16_present()
            }
            "mpi" => {
                println!("cargo:rerun-if-env-changed=PATH");
                if let Some(paths) = std::env::var_os("PATH") {
                    // System directories only: a user's own bin directories change too often.
                    std::env::split_paths(&paths)
                        .filter(|d| d.starts_with("/usr") || d.starts_with("/opt"))
                        .for_each(|d| rerun_if_changed(&d));
                }
                on_path("mpirun")
            }
            "netns" => {
                // Network namespaces, veth pairs and tc shaping (scripts/netns-cluster.sh): root,
                // iproute2's `ip` and `tc`.
                println!("cargo:rerun-if-env-changed=PATH");
                let root = std::process::Command::new("id")
                    .arg("-u")
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
                // And that this machine lets it make one (a container may not): `unshare --net`
                // makes a namespace that ends with its process, leaving nothing behind.
                let allowed = || {
                    std::process::Command::new("unshare")
                        .args(["--net", "true"])
                        .stderr(std::process::Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                };
                root && on_path("ip") && on_path("tc") && allowed()
            }
            other => panic!("probe: unknown capability `{other}`"),
        };
        if !present && required.iter().any(|r| r == need) {
            println!("cargo:warning=DISAGMOE_REQUIRE names {need} but this machine lacks it: its tests will run and fail");
        } else if !present {
            println!("cargo:rustc-cfg=disagmoe_no_{need}");
        }
    }
}
