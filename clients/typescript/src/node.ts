// Transports for Node: gRPC over HTTP/2 (h2c to a plaintext registry, or
// TLS), with an optional bearer token.
import type { Interceptor, Transport } from "@connectrpc/connect";
import { createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";

export interface NodeTransportOptions extends Partial<GrpcTransportOptions> {
  /** http://host:port for a plaintext registry (h2c), https://host:port for TLS. */
  baseUrl: string;
  /**
   * A token from `idemreg new-token`, sent as authorization: Bearer on
   * every call. Refused over http:// unless allowInsecureToken (a
   * registry on loopback), as the Go client's BearerToken is.
   */
  token?: string;
  allowInsecureToken?: boolean;
}

/** A gRPC transport to the registry for Node. */
export function createNodeTransport(opts: NodeTransportOptions): Transport {
  const { token, allowInsecureToken, ...rest } = opts;
  const interceptors: Interceptor[] = [...(rest.interceptors ?? [])];
  if (token !== undefined) {
    if (!/^[\x21-\x7e]+$/.test(token)) {
      throw new Error("idemreg: the token must be printable ASCII without spaces (a trailing newline from a file?)");
    }
    if (!opts.baseUrl.startsWith("https://") && !allowInsecureToken) {
      throw new Error("idemreg: a token is sent over TLS only (https://); set allowInsecureToken for a registry on loopback");
    }
    interceptors.push((next) => (req) => {
      req.header.set("authorization", `Bearer ${token}`);
      return next(req);
    });
  }
  return createGrpcTransport({ ...rest, interceptors });
}
