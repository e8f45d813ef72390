package postgres

// ClaimSQL is the Claim statement, for the plan test.
var ClaimSQL = claimSQL
