// @idemreg/client: the TypeScript client of the idemreg registry. It takes
// any Connect transport; Node's is in @idemreg/client/node, kept apart so
// that a browser bundle does not pull in node:http2.
export * from "./client.js";
export * from "./errors.js";
export * from "./gen/idemreg/v1/registry_pb.js";
export * as admin from "./gen/idemreg/v1/admin_pb.js";
export { ErrorReason } from "./gen/idemreg/v1/error_reason_pb.js";
