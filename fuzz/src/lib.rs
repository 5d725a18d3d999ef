//! What several fuzz targets share: a global allocator that counts the bytes an input makes the
//! code under test hold, a working directory per process, and a `disagmoe tokenize` run on the
//! input's bytes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use disagmoe_train::data::tokenize::{tokenize, TokenizeOptions, TokenizeReport};

/// A global allocator counting live bytes and their peak; a target that bounds memory declares
/// `#[global_allocator] static ALLOC: Counting = Counting;` and measures with [`peak_during`].
pub struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

/// Runs `f` and returns its result with the most bytes live at once during it, beyond those live
/// before (one thread: the targets run their input on the thread that calls this).
pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed) - before)
}

/// This process's working directory, `$TMPDIR/disagmoe-fuzz-<name>-<pid>`, made on first use;
/// rayon's pool is one thread (set before anything starts it).
pub fn work_dir(name: &str) -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        std::env::set_var("RAYON_NUM_THREADS", "1");
        let dir = std::env::temp_dir().join(format!("disagmoe-fuzz-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// `disagmoe tokenize` on `data` written as `in.<ext>` (byte-level tokenizer, field `text`, shards
/// of 1 to 64 tokens so that inputs span several), into `out` of the working directory (removed
/// first). A failed run must leave no `out.partial` behind: checked here.
pub fn tokenize_bytes(data: &[u8], ext: &str) -> (disagmoe_train::Result<TokenizeReport>, PathBuf) {
    let dir = work_dir(ext);
    let (input, out) = (dir.join(format!("in.{ext}")), dir.join("out"));
    std::fs::write(&input, data).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let opts = TokenizeOptions {
        inputs: vec![input],
        out: out.clone(),
        tokenizer: None,
        text_field: "text".into(),
        eos: None,
        shard_tokens: 1 + (data.len() % 64) as u64,
        progress: false,
    };
    let report = tokenize(&opts);
    assert!(!dir.join("out.partial").exists(), "no partial directory is left");
    (report, out)
}
