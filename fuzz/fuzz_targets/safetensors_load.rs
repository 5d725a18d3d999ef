//! Any bytes as a safetensors shard: opening it and reading every tensor (as f32, or raw u8 for
//! MXFP4 blocks), whole and as the row range an expert shard reads, returns values or errors,
//! never panics; a row range that reads is the matching slice of the whole tensor.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("disagmoe-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    // The rows to read come from the input's last two bytes.
    let (first, n) = match data {
        [.., a, b] => (usize::from(*a % 8), usize::from(*b % 8)),
        _ => (0, 1),
    };
    if let Ok(mut reader) = disagmoe_models::CheckpointReader::open_file(&path) {
        for name in reader.names() {
            let whole = reader.read_f32(&name);
            let rows = reader.read_rows_f32(&name, first, n);
            if let (Ok((shape, all)), Ok((rshape, part))) = (&whole, &rows) {
                let width: usize = shape.iter().skip(1).product();
                assert_eq!(rshape, shape, "a row read reports the whole tensor's shape");
                // Bit for bit (a NaN read is a NaN).
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&all[first * width..(first + n) * width]), bits(part));
            }
            let _ = reader.read_u8(&name);
            let _ = reader.read_rows_u8(&name, first, n);
        }
    }
});
