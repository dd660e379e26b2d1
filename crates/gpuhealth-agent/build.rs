//! Generates the PodResources gRPC client (and the server the tests run)
//! from `proto/`, with protox: no protoc needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/podresources.proto");
    let descriptors = protox::compile(["podresources.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
